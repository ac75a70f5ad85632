"""Ordered and cumulative ops: cumulative sums, products, extremes and logsumexp; searching sorted
sequences (searchsorted, bucketize); histograms; reductions over runs of consecutive elements
(segment_reduce)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, dim as norm_dim, in_float32, unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


# -- cumulative ops --------------------------------------------------------------------------------
# torch's CPU kernels accumulate half-precision scans in float32 and round each output once

def _cumulative(fn):
    def lowering(x, dim, dtype=None):
        if dtype is not None:
            x = x.astype(dtype)  # torch converts the input first, then accumulates
        return in_float32(lambda v: v if v.ndim == 0 else fn(v, axis=norm_dim(dim, v.ndim)))(x)
    return lowering


register(aten.cumsum.default)(_cumulative(jnp.cumsum))
register(aten.cumprod.default)(_cumulative(jnp.cumprod))


def _cumulative_extreme(x, dim, scan, keep):
    """(values, indices) of cummax / cummin: the index is the latest one holding the running extreme
    (`keep` is >= or <=), and once a NaN is seen the latest NaN, as torch's CPU kernel does."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = norm_dim(dim, x.ndim)
    running = scan(x, axis=d)  # XLA's max / min propagate NaN, as torch's running extreme does
    position = lax.broadcasted_iota(jnp.int32, x.shape, d)
    holds = keep(x, running)
    if jnp.issubdtype(x.dtype, jnp.floating):
        holds = holds | jnp.isnan(x)
    index = lax.cummax(jnp.where(holds, position, 0), axis=d)
    # the values are read back at the index, so the gradient reaches it (torch's cummaxmin_backward)
    return jnp.take_along_axis(x, index, axis=d), index


@register(aten.cummax.default)
def cummax(x, dim):
    return _cumulative_extreme(x, dim, lax.cummax, jnp.greater_equal)


@register(aten.cummin.default)
def cummin(x, dim):
    return _cumulative_extreme(x, dim, lax.cummin, jnp.less_equal)


@functools.partial(custom_vjp, nondiff_argnums=(1,))
def _logcumsumexp(x, d):
    return lax.cumlogsumexp(x, axis=d)


def _logcumsumexp_fwd(x, d):
    result = _logcumsumexp(x, d)
    return result, (x, result)


def _logcumsumexp_bwd(d, saved, g):
    # torch's logcumsumexp_backward: the positive and negative parts of the cotangent, each summed
    # in log space from the end, so infinities give torch's values (plain autodiff differs there)
    x, result = saved
    lowest = jnp.finfo(g.dtype).min
    log_g = jnp.log(jnp.abs(g))

    def reverse(v):
        return jnp.flip(lax.cumlogsumexp(jnp.flip(v, d), axis=d), d)

    positive = jnp.exp(reverse(jnp.where(g > 0, log_g, lowest) - result) + x)
    negative = jnp.exp(reverse(jnp.where(g < 0, log_g, lowest) - result) + x)
    return (positive - negative,)


_logcumsumexp.defvjp(_logcumsumexp_fwd, _logcumsumexp_bwd)


@register(aten.logcumsumexp.default)
@in_float32
def logcumsumexp(x, dim):
    return x if x.ndim == 0 else _logcumsumexp(x, norm_dim(dim, x.ndim))


# -- searching sorted sequences --------------------------------------------------------------------

def _search(boundaries, values, right, sorter=None):
    """torch's binary search (aten/src/ATen/native/BucketizationUtils.h), step for step, so NaN
    lands where torch puts it: the first position whose boundary is >= (> when `right`) the
    value, found as torch's loop finds it, vectorized over every value."""
    n = boundaries.shape[-1]
    if sorter is not None:
        boundaries = jnp.take_along_axis(boundaries, sorter, axis=-1)
    start = jnp.zeros(jnp.shape(values), jnp.int32)
    end = jnp.full(jnp.shape(values), n, jnp.int32)
    for _ in range(int(n).bit_length()):
        mid = start + ((end - start) >> 1)
        at = jnp.minimum(mid, max(n - 1, 0))
        bound = boundaries[at] if boundaries.ndim == 1 else jnp.take_along_axis(boundaries, at, axis=-1)
        left = (bound > values) if right else (bound >= values)
        active = start < end
        start = jnp.where(active & ~left, mid + 1, start)
        end = jnp.where(active & left, mid, end)
    return start


def _side(op, right, side):
    if side is None:
        return bool(right)
    if side not in ("left", "right") or (right and side == "left"):
        raise unsupported_arg(op, f"side={side!r}, right={right!r}")
    return side == "right"


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    values = jnp.asarray(values)
    if sorted_sequence.ndim > 1 and values.ndim == 0:
        raise unsupported_arg("aten.searchsorted", "a 0-d value against an N-d sequence")
    return _search(sorted_sequence, values, _side("aten.searchsorted", right, side), sorter)


@register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(values, boundaries, *, out_int32=False, right=False):
    return _search(boundaries, jnp.asarray(values), right)


# -- histograms ------------------------------------------------------------------------------------
# torch's CPU histogram kernel (aten/src/ATen/native/cpu/HistogramKernel.cpp) computes in the
# input's dtype; half-precision steps are rounded to it one by one here, as there.

def _rounded(value, dtype):
    if dtype in (jnp.bfloat16, jnp.float16):
        info = jnp.finfo(dtype)
        return lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return value


def _linspace(start, end, steps, dtype):
    """torch's CPU linspace in `dtype`: from the start for the first half, from the end after."""
    start, end = _rounded(start, dtype), _rounded(end, dtype)
    i = jnp.arange(steps, dtype=jnp.float32)
    step = _rounded((end - start) / max(steps - 1, 1), dtype)
    head = _rounded(start + _rounded(step * i, dtype), dtype)
    tail = _rounded(end - _rounded(step * (steps - 1 - i), dtype), dtype)
    return jnp.where(jnp.arange(steps) < steps // 2, head, tail)


def _bin(x, edges, method):
    """Each value's bin among `edges` (-1 when outside them or NaN), by torch's bin-selection
    algorithm: 'linear' (histc), 'local' (linear, then a search of the neighbouring edges;
    histogram with a bin count) or 'search' (histogram with given edges)."""
    dtype = x.dtype
    x32, edges32 = x.astype(jnp.float32), edges.astype(jnp.float32)
    n = edges.shape[0]
    lo, hi = edges32[0], edges32[-1]
    inside = (x32 >= lo) & (x32 <= hi)
    if method == "search":
        pos = _search(edges32, x32, True) - 1
    else:
        scaled = _rounded(_rounded(_rounded(x32 - lo, dtype) * _rounded(jnp.float32(n - 1), dtype), dtype)
                          / _rounded(hi - lo, dtype), dtype)
        pos = jnp.where(inside, scaled, 0).astype(jnp.int32)  # truncation, as the C++ cast
        if method == "local":
            # the upper bound of the value among edges[pos - 1 : pos + 2]
            base = jnp.maximum(pos - 1, 0)
            above = jnp.zeros_like(pos)
            for k in range(3):
                at = base + k
                above += ((at < jnp.minimum(pos + 2, n)) & (edges32[jnp.minimum(at, n - 1)] <= x32))
            pos = base + above - 1
    pos = jnp.where(pos == n - 1, n - 2, pos)  # the last bin holds its right edge
    return jnp.where(inside, pos, -1)


def _histogramdd(x, edges, method, weight, density, dtype):
    """The histogram of the rows of x (N, D) over the D edge vectors, as torch's kernel fills it."""
    sizes = [e.shape[0] - 1 for e in edges]
    flat = jnp.zeros(x.shape[:1], jnp.int32)
    valid = jnp.ones(x.shape[:1], bool)
    for d, e in enumerate(edges):
        pos = _bin(x[:, d], e, method)
        valid &= pos >= 0
        flat = flat * sizes[d] + jnp.maximum(pos, 0)
    total = int(np.prod(sizes))
    if weight is None:
        counts = jnp.zeros((total,), jnp.int32).at[flat].add(valid.astype(jnp.int32))
        hist = counts.astype(jnp.float32)
    else:
        hist = jnp.zeros((total,), jnp.float32).at[flat].add(jnp.where(valid, weight.astype(jnp.float32), 0))
    hist = hist.reshape(sizes)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            shape = [1] * len(sizes)
            shape[d] = sizes[d]
            hist = hist / jnp.diff(e.astype(jnp.float32)).reshape(shape)
    return hist.astype(dtype)


def _outer_edges(x, bounds, pad):
    """The outermost edges: `bounds`, else the data's extremes (torch raises where they are not
    finite; here they give NaN edges and an empty histogram); equal edges are widened by `pad`."""
    if bounds is not None:
        if not np.all(np.isfinite(bounds)) or bounds[0] > bounds[1]:
            raise unsupported_arg("aten.histc / aten.histogram",
                                  f"range {tuple(bounds)} (torch raises too: it must be finite and increasing)")
        lo, hi = jnp.float32(bounds[0]), jnp.float32(bounds[1])
    elif x.size:
        lo, hi = jnp.min(x).astype(jnp.float32), jnp.max(x).astype(jnp.float32)
    else:
        lo = hi = jnp.float32(0)
    same = lo == hi
    return jnp.where(same, lo - pad, lo), jnp.where(same, hi + pad, hi)


@register(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    # torch takes the data's range when min == max
    lo, hi = _outer_edges(x, (min, max) if min != max or not x.size else None, 1.0)
    edges = _linspace(lo, hi, bins + 1, x.dtype)
    return _histogramdd(x.reshape(-1, 1), [edges], "linear", None, False, x.dtype)


def _edges_dd(x, bins, bounds):
    """histogramdd's bin edges: per column of x (N, D), `bins[d] + 1` evenly spaced edges."""
    return [_linspace(*_outer_edges(x[:, d], None if bounds is None else bounds[2 * d:2 * d + 2], 0.5),
                      bins[d] + 1, x.dtype) for d in range(x.shape[1])]


@register(aten.histogram.bin_ct)
def histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    edges = _edges_dd(x.reshape(-1, 1), [bins], range)
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(x.reshape(-1, 1), edges, "local", w, density, x.dtype), edges[0].astype(x.dtype)


@register(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(x.reshape(-1, 1), [bins], "search", w, density, x.dtype), bins


@register(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    x = x.reshape(-1, x.shape[-1])
    return [e.astype(x.dtype) for e in _edges_dd(x, bins, range)]


@register(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    x = x.reshape(-1, x.shape[-1])
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(x, _edges_dd(x, bins, range), "local", w, density, x.dtype)


@register(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    x = x.reshape(-1, x.shape[-1])
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(x, list(bins), "search", w, density, x.dtype)


# -- reductions over runs of consecutive elements --------------------------------------------------

def _segment(data, ids, count, reduce, initial):
    """torch's segment reduction of data's rows (N, ...) into `count` segments by `ids` (N,), before
    the mean's division: empty segments hold `initial` or the reduction's identity."""
    if reduce in ("sum", "mean"):
        total = jax.ops.segment_sum(data, ids, count)
        return total if initial is None else total + initial
    if reduce == "prod":
        total = jax.ops.segment_prod(data, ids, count)
        return total if initial is None else total * initial
    # segment_max / segment_min propagate NaN and leave -inf / inf in empty segments, as torch
    extreme = (jax.ops.segment_max if reduce == "max" else jax.ops.segment_min)(data, ids, count)
    if initial is None:
        return extreme
    return (jnp.maximum if reduce == "max" else jnp.minimum)(extreme, jnp.asarray(initial, data.dtype))


@functools.partial(custom_vjp, nondiff_argnums=(2, 3, 4))
def _segment_vjp(data, ids, count, reduce, initial):
    return _segment(data, ids, count, reduce, initial)


def _segment_fwd(data, ids, count, reduce, initial):
    out = _segment(data, ids, count, reduce, initial)
    return out, (data, ids, out)


def _segment_bwd(count, reduce, initial, saved, g):
    """torch's _segment_reduce_backward CPU kernel (aten/src/ATen/native/SegmentReduce.cpp)."""
    data, ids, out = saved
    g_at, out_at = g[ids], out[ids]
    nan = jnp.isnan(data)
    if reduce in ("max", "min"):
        # the gradient goes to every element equal to the extreme (or NaN); when several are, torch
        # divides the positive shares among them and leaves the others whole
        hit = nan | (data == out_at)
        grad = jnp.where(hit, g_at, 0)
        hits = jax.ops.segment_sum(hit.astype(jnp.int32), ids, count)[ids]
        return jnp.where((hits >= 2) & (grad > 0), grad / hits.astype(grad.dtype), grad), None
    # prod: the output over the element, or the product of the others where it is 0 or NaN
    special = nan | (data == 0)
    one = jnp.ones((), data.dtype)
    rest = jax.ops.segment_prod(jnp.where(special, one, data), ids, count)
    if initial is not None:
        rest = rest * initial
    specials = jax.ops.segment_sum(special.astype(jnp.int32), ids, count)[ids]
    nans = jax.ops.segment_sum(nan.astype(jnp.int32), ids, count)[ids] - nan
    others = jnp.where(specials == 1, one, jnp.where(nans > 0, jnp.nan, 0).astype(data.dtype))
    exclusive = rest[ids] * others
    return jnp.where(special, g_at * exclusive, g_at * out_at / jnp.where(special, one, data)), None


_segment_vjp.defvjp(_segment_fwd, _segment_bwd)


@register(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    if indices is not None or (lengths is None and offsets is None):
        raise unsupported_arg("aten.segment_reduce", "indices= (torch implements lengths= and offsets=)")
    if reduce not in ("sum", "mean", "prod", "max", "min"):
        raise unsupported_arg("aten.segment_reduce", f"reduce={reduce!r}")
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    a = norm_dim(axis, data.ndim)
    outer, n, inner = data.shape[:a], data.shape[a], data.shape[a + 1:]
    segments, rows = lengths.shape[-1], int(np.prod(outer))
    ends = jnp.cumsum(lengths.reshape(rows, segments), axis=-1)
    # each position's segment: the number of segment ends at or before it (`segments`: past them all)
    ids = jnp.sum(jnp.arange(n)[None, :, None] >= ends[:, None, :], axis=-1)
    ids = (ids + jnp.arange(rows)[:, None] * (segments + 1)).reshape(-1)
    flat = data.reshape((rows * n,) + inner)
    count = rows * (segments + 1)
    if reduce in ("sum", "mean") or not jnp.issubdtype(data.dtype, jnp.floating):
        out = _segment(flat, ids, count, reduce, initial)
    else:
        out = _segment_vjp(flat, ids, count, reduce, initial)
    out = out.reshape((rows, segments + 1) + inner)[:, :segments].reshape(outer + (segments,) + inner)
    if reduce == "mean":
        size = lengths.reshape(outer + (segments,) + (1,) * len(inner)).astype(out.dtype)
        empty = jnp.asarray(jnp.nan if initial is None else initial, out.dtype)
        out = jnp.where(size > 0, out / jnp.maximum(size, 1), empty)
    return out
