"""Convolution and pooling over the trailing 1-3 spatial dims (NCHW layout, as torch)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, unsupported_arg
from tpudist.compile._torch.lowering.ops.linalg import accumulation, with_bias
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _per_dim(value, n):
    value = [value] if isinstance(value, int) else list(value)
    return value * n if len(value) == 1 else value


@register(aten.convolution.default)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = weight.ndim - 2
    stride, padding, dilation = (_per_dim(v, nd) for v in (stride, padding, dilation))
    spatial = "DHW"[-nd:] if nd <= 3 else None
    if spatial is None:
        raise unsupported_arg("aten.convolution", f"{nd} spatial dims")
    dn = lax.conv_dimension_numbers(x.shape, weight.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    if not transposed:
        out = lax.conv_general_dilated(x, weight, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                       dimension_numbers=dn, feature_group_count=groups, **accumulation(x, weight))
    else:
        # a transposed conv is the plain conv of the stride-dilated input with the flipped kernel,
        # in/out channels swapped within each group
        k = weight.shape[2:]
        cin, cout_g = weight.shape[:2]
        w = weight.reshape((groups, cin // groups, cout_g) + k).swapaxes(1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, tuple(range(2, 2 + nd)))
        extra = _per_dim(output_padding, nd)
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + e) for kk, p, d, e in zip(k, padding, dilation, extra)]
        dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
        out = lax.conv_general_dilated(x, w, (1,) * nd, pads, lhs_dilation=stride, rhs_dilation=dilation,
                                       dimension_numbers=dn, feature_group_count=groups, **accumulation(x, w))
    return with_bias(None if bias is None else bias.reshape((1, -1) + (1,) * nd), out)


def _window(size, k, s, p, d, ceil_mode):
    """torch's pooling geometry along one dim: (output size, right padding that yields it)."""
    span = d * (k - 1) + 1
    out = (size + 2 * p - span + ((s - 1) if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window must start inside the input or the left padding
    return out, max((out - 1) * s + span - size - p, 0)


def _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode, nd):
    k = _per_dim(kernel_size, nd)
    s = _per_dim(stride, nd) if stride else k
    p, d = _per_dim(padding, nd), _per_dim(dilation, nd)
    lead = x.ndim - nd
    geometry = [_window(x.shape[lead + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(nd)]
    pads = [(0, 0)] * lead + [(p[i], geometry[i][1]) for i in range(nd)]
    one = (1,) * lead
    return one + tuple(k), one + tuple(s), pads, one + tuple(d), [g[0] for g in geometry]


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nd):
    """(values, indices): indices are flat positions within each input plane, as torch reports."""
    window, strides, pads, dil, _ = _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode, nd)
    # a Python scalar init lets JAX recognize the max monoid
    lowest = -float("inf") if jnp.issubdtype(x.dtype, jnp.floating) else int(jnp.iinfo(x.dtype).min)
    plane = x.shape[x.ndim - nd:]
    flat = jnp.broadcast_to(jnp.arange(int(np.prod(plane)), dtype=jnp.int32).reshape(plane), x.shape)

    def first_max(a, b):  # the earliest position among equal maxima, as torch reports it
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    _, indices = lax.reduce_window((lax.stop_gradient(x), flat), (jnp.asarray(lowest, x.dtype), jnp.int32(2**31 - 1)),
                                   first_max, window, strides, pads, window_dilation=dil)
    geometry = (window[-nd:], strides[-nd:], [p[0] for p in pads[-nd:]], dil[-nd:])

    @custom_vjp
    def pooled(x, indices):
        return lax.reduce_window(x, lowest, lax.max, window, strides, pads, window_dilation=dil)

    def forward(x, indices):
        return pooled(x, indices), indices

    def backward(indices, grad):
        return _to_argmax(grad, indices, x.shape, *geometry), None

    pooled.defvjp(forward, backward)
    return pooled(x, indices), indices


def _to_argmax(grad, indices, shape, kernel, strides, pads, dilation):
    """The max-pool gradient: each output's gradient goes to its argmax input position, as torch's.

    XLA's own rule (select-and-scatter) is slow on CPU and has no form for dilated windows; this
    one is k*k elementwise passes: for each window offset, the outputs whose argmax sits at that
    offset, placed onto the input grid with a strided (interior) pad.
    """
    nd = len(kernel)
    lead, plane = len(shape) - nd, shape[len(shape) - nd:]
    outs = grad.shape[lead:]
    total = jnp.zeros(shape, grad.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        starts = [o * d - p for o, d, p in zip(offset, dilation, pads)]
        position = jnp.zeros(outs, jnp.int32)
        inside = jnp.ones(outs, bool)
        for i in range(nd):
            coord = (jnp.arange(outs[i]) * strides[i] + starts[i]).reshape((-1,) + (1,) * (nd - 1 - i))
            position = position * plane[i] + coord
            inside = inside & (coord >= 0) & (coord < plane[i])
        part = jnp.where((indices == position) & inside, grad, 0)
        config = [(0, 0, 0)] * lead + [(starts[i], plane[i] - starts[i] - (outs[i] - 1) * strides[i] - 1, strides[i] - 1)
                                       for i in range(nd)]
        total = total + lax.pad(part, jnp.zeros((), grad.dtype), config)
    return total


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 2)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _avg_divisor(size, out, k, s, p, count_include_pad):
    """Per-output-position divisor along one dim, computed at trace time from static shapes."""
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    if count_include_pad:
        return (end - start).astype(np.float32)
    return (np.minimum(end, size) - np.maximum(start, 0)).astype(np.float32)


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    window, strides, pads, _, outs = _pool_args(x, kernel_size, stride, padding, 1, ceil_mode, nd)
    sums = lax.reduce_window(x, 0.0 if jnp.issubdtype(x.dtype, jnp.floating) else 0, lax.add, window, strides, pads)
    if divisor_override:
        return sums / divisor_override
    lead = x.ndim - nd
    divisor = np.ones((), np.float32)
    for i in range(nd):
        per_dim = _avg_divisor(x.shape[lead + i], outs[i], window[lead + i], strides[lead + i],
                               pads[lead + i][0], count_include_pad)
        divisor = np.multiply.outer(divisor, per_dim)
    return sums / jnp.asarray(divisor, x.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@register(aten.avg_pool3d.default)
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


def _adaptive_avg(x, output_size, nd):
    lead = x.ndim - nd
    for i, out in enumerate(_per_dim(output_size, nd)):
        axis, size = lead + i, x.shape[lead + i]
        if size % out == 0:
            shape = x.shape[:axis] + (out, size // out) + x.shape[axis + 1:]
            x = jnp.mean(x.reshape(shape), axis=axis + 1)
            continue
        # uneven windows [floor(o*size/out), ceil((o+1)*size/out)): an averaging matrix
        weights = np.zeros((out, size), np.float32)
        for o in range(out):
            lo, hi = (o * size) // out, -((-(o + 1) * size) // out)
            weights[o, lo:hi] = 1.0 / (hi - lo)
        x = jnp.moveaxis(jnp.tensordot(x, jnp.asarray(weights, x.dtype).T, axes=([axis], [0]),
                                       precision=lax.Precision.HIGHEST), -1, axis)
    return x


@register(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg(x, output_size, 2)


@register(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(x, output_size):
    return _adaptive_avg(x, output_size, 3)


def _to_indices(grad, x, indices, nd):
    """Each output's gradient added at its recorded argmax (flat within the input plane)."""
    rows = int(np.prod(x.shape[:x.ndim - nd]))
    total = jnp.zeros((rows, int(np.prod(x.shape[x.ndim - nd:]))), grad.dtype)
    total = total.at[jnp.arange(rows)[:, None], indices.reshape(rows, -1)].add(grad.reshape(rows, -1))
    return total.reshape(x.shape)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _to_indices(grad, x, indices, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _to_indices(grad, x, indices, 3)


# -- adaptive and fractional max pooling: windows of varying start, ATen's choice of maximum ------

def _window_max(x, starts, lengths, nd):
    """(values, indices) of max pooling over arbitrary windows, as ATen's adaptive and fractional
    kernels: along spatial dim k, output o reads input positions starts[k][..., o] + j for
    j < lengths[k][o] (starts: static (out,), or one row per plane (planes, out)); the maximum is
    the first in row-major order, or the last NaN when the window holds one (`val > max || isnan`)."""
    lead, sizes = x.shape[:x.ndim - nd], x.shape[x.ndim - nd:]
    flat, valid = 0, True
    for k in range(nd):
        taps = int(np.max(lengths[k]))
        start = jnp.asarray(starts[k]).reshape((-1, len(lengths[k])))  # (1 or planes, out)
        # laid out as (planes, o1, .., ond, t1, .., tnd): this dim's out and tap axes, 1 elsewhere
        out_axes = (1,) * k + (len(lengths[k]),) + (1,) * (nd - 1 - k)
        tap_axes = (1,) * k + (taps,) + (1,) * (nd - 1 - k)
        position = start.reshape((start.shape[0],) + out_axes + (1,) * nd) + jnp.arange(taps).reshape(tap_axes)
        flat = flat * sizes[k] + jnp.clip(position, 0, sizes[k] - 1)
        valid = valid & (np.arange(taps) < np.asarray(lengths[k])[:, None]).reshape(out_axes + tap_axes)
    outs = valid.shape[:nd]
    flat = flat.reshape((flat.shape[0], int(np.prod(outs)), -1))
    valid = jnp.asarray(valid.reshape((int(np.prod(outs)), -1)))
    values = jnp.take_along_axis(x.reshape(-1, int(np.prod(sizes))), flat.reshape(flat.shape[0], -1), axis=1)
    values = values.reshape((-1,) + valid.shape)
    seen = lax.stop_gradient(values)
    nan = jnp.isnan(seen) & valid
    candidates = jnp.where(valid, seen, -jnp.inf)
    first_max = jnp.argmax(candidates == jnp.max(candidates, axis=-1, keepdims=True), axis=-1)
    last_nan = valid.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    chosen = jnp.where(jnp.any(nan, axis=-1), last_nan, first_max)[..., None]
    out = jnp.take_along_axis(values, chosen, axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(flat, values.shape), chosen, axis=-1)[..., 0]
    return out.reshape(lead + outs), indices.reshape(lead + outs)


def _adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    # ATen's start_index / end_index: [floor(o * size / out), ceil((o + 1) * size / out))
    o = np.arange(out)
    start = (o * size) // out
    end = -((-(o + 1) * size) // out)
    return start, end - start


def _adaptive_max(x, output_size, nd):
    windows = [_adaptive_windows(x.shape[x.ndim - nd + k], out) for k, out in enumerate(_per_dim(output_size, nd))]
    return _window_max(x, [w[0] for w in windows], [w[1] for w in windows], nd)


@register(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(x, output_size):
    return _adaptive_max(x, output_size, 2)


@register(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(x, output_size):
    return _adaptive_max(x, output_size, 3)


def _fractional_starts(sample, size: int, out: int, pool: int):
    """ATen's `generate_intervals`, in the samples' dtype as the kernel computes: each window's start
    from the plane's random sample u in [0, 1): int((i + u) * alpha) - int(u * alpha), the last
    window flush with the end."""
    def rounded(v):  # each step of the C++ arithmetic rounds to the samples' dtype
        return v.astype(sample.dtype).astype(jnp.float32)

    last = jnp.full(sample.shape + (1,), size - pool, jnp.int32)
    if out == 1:
        return last
    u = sample.astype(jnp.float32)
    alpha = rounded(rounded(jnp.float32(size - pool)) / rounded(jnp.float32(out - 1)))
    i = jnp.arange(out - 1, dtype=jnp.float32)
    starts = (rounded(rounded(i + u[..., None]) * alpha).astype(jnp.int32)
              - rounded(u * alpha).astype(jnp.int32)[..., None])
    return jnp.concatenate([starts, last], axis=-1)


def _fractional_max(x, kernel_size, output_size, samples, nd, sample_of_dim):
    pools, outs = _per_dim(kernel_size, nd), _per_dim(output_size, nd)
    samples = samples.reshape((-1, samples.shape[-1]))  # (planes, nd): one sample per plane and dim
    starts = [_fractional_starts(samples[:, sample_of_dim[k]], x.shape[x.ndim - nd + k], outs[k], pools[k])
              for k in range(nd)]
    return _window_max(x, starts, [np.full(outs[k], pools[k]) for k in range(nd)], nd)


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    # the kernel reads each plane's samples as (width, height)
    return _fractional_max(x, kernel_size, output_size, random_samples, 2, (1, 0))


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    # ... and as (time, height, width) in 3-d
    return _fractional_max(x, kernel_size, output_size, random_samples, 3, (0, 1, 2))
