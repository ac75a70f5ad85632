"""Resampling by interpolation: F.interpolate in every mode torch has, with the gradients JAX
derives from it (grid sampling is in `grid_sample`).

Interpolation follows ATen's CPU kernels (UpSampleKernel.cpp) index by index, in the same float32
steps: source positions from `area_pixel_compute_source_index`, with the caller's scale factor
where one is given (not the ratio of the rounded sizes). Two of the kernels' rules are not what the
scale factor says: the linear modes copy a side whose size does not change (F.interpolate(x,
scale_factor=1.2) on a 4-pixel side), and nearest's channels-last loop, and its backward always,
copy such a side and halve the index of a doubled one (`_shortcuts`). torch._decomp's
decompositions, which torch.export's own table applies to several of these ops, follow neither
rule, so every nearest and linear overload is lowered here (`keep_whole` where the table would
decompose it); bicubic is left to its decomposition, which matches its kernel, and area is
adaptive average pooling (conv_pool).

Antialiased bilinear / bicubic (Pillow's filters) are lowered: their tap positions and weights are
those of ATen's CPU kernels, computed in the same float32 steps, and taps that fall outside the
input are left out rather than multiplied by zero, so an inf or NaN in the input spreads exactly
as far as in torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, in_float32
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


_f32 = np.float32


def _output_size(x, output_size, scale_factors):
    """The `.vec` overloads' output size: given, or each input size times its scale, truncated."""
    if output_size is not None:
        return list(output_size)
    lead = x.ndim - len(scale_factors)
    return [int(x.shape[lead + k] * s) for k, s in enumerate(scale_factors)]


def _scale_value(in_size: int, out_size: int, scale: float | None) -> np.float32:
    """ATen's `compute_scales_value<float>`: input pixels per output pixel, from the caller's scale
    factor when one is given."""
    if scale is not None and scale > 0:
        return _f32(1.0 / scale)
    return _f32(in_size) / _f32(out_size)


def _area_scale(in_size: int, out_size: int, align_corners: bool, scale: float | None) -> np.float32:
    """ATen's `area_pixel_compute_scale<float>`."""
    if align_corners:
        return _f32(in_size - 1) / _f32(out_size - 1) if out_size > 1 else _f32(0)
    return _scale_value(in_size, out_size, scale)


# -- nearest ---------------------------------------------------------------------------------------

def _nearest_index(in_size: int, out_size: int, scale: float | None, exact: bool, shortcuts: bool) -> np.ndarray:
    if shortcuts and out_size == in_size:  # ATen's `nearest_idx`: a copy, a doubling: whatever the scale
        return np.arange(out_size)
    if shortcuts and out_size == 2 * in_size:
        return np.arange(out_size) >> 1
    position = np.arange(out_size, dtype=_f32) + (_f32(0.5) if exact else _f32(0))
    return np.minimum(np.floor(position * _scale_value(in_size, out_size, scale)).astype(np.int64), in_size - 1)


def _take(x, lead: int, indices):
    for k, index in enumerate(indices):
        x = jnp.take(x, jnp.asarray(index), axis=lead + k)
    return x


def _upsample_nearest(x, output_size, scales, exact: bool, shortcuts: bool = False):
    lead = x.ndim - len(output_size)
    scales = scales or [None] * len(output_size)
    sizes = [(x.shape[lead + k], out, scales[k]) for k, out in enumerate(output_size)]
    forward = [_nearest_index(i, o, s, exact, shortcuts) for i, o, s in sizes]
    # ATen's backward (`cpu_upsample_nearest_backward`) always indexes with `nearest_idx`'s
    # shortcuts, also where its forward loop did not: the gradient then is not the forward's transpose
    backward = forward if exact else [_nearest_index(i, o, s, exact, True) for i, o, s in sizes]
    if all(np.array_equal(f, b) for f, b in zip(forward, backward)):
        return _take(x, lead, forward)
    shape, dtype = x.shape, x.dtype

    @custom_vjp
    def resized(x):
        return _take(x, lead, forward)

    def gradient(_, g):
        return jax.vjp(lambda x: _take(x, lead, backward), jnp.zeros(shape, dtype))[1](g)

    resized.defvjp(lambda x: (resized(x), None), gradient)
    return resized(x)


def _shortcuts(meta, output_size) -> bool:
    """Whether ATen's CPU kernel resizes with its channels-last loop (`nearest_idx`), which copies a
    side whose size does not change, and halves the index of one that doubles, whatever the scale
    factor says; its other loop (and CUDA's kernel) applies the scale factor. The 2-d loop is taken
    for channels-last inputs of over 3 channels and for small outputs, the 3-d one for
    channels-last inputs of over 3 channels; 1-d never."""
    nd = len(output_size)
    layout = {2: torch.channels_last, 3: torch.channels_last_3d}.get(nd)
    channels_last = layout is not None and meta is not None and meta.is_contiguous(memory_format=layout)
    return (channels_last and meta.shape[1] > 3) or (nd == 2 and sum(output_size) <= 128)


@register(aten.upsample_nearest1d.default)
def upsample_nearest1d(x, output_size, scales=None):
    return _upsample_nearest(x, output_size, [scales], exact=False)


@register(aten.upsample_nearest2d.default, input_meta=True)
def upsample_nearest2d(x, output_size, scales_h=None, scales_w=None, *, meta=None):
    return _upsample_nearest(x, output_size, [scales_h, scales_w], False, _shortcuts(meta, output_size))


@register(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec, input_meta=True)
def upsample_nearest_vec(x, output_size, scale_factors, *, meta=None):
    size = _output_size(x, output_size, scale_factors)
    return _upsample_nearest(x, size, scale_factors, False, _shortcuts(meta, size))


@register(aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact3d.vec)
def upsample_nearest_exact_vec(x, output_size, scale_factors):
    return _upsample_nearest(x, _output_size(x, output_size, scale_factors), scale_factors, exact=True)


@register(aten.upsample_nearest3d.default, input_meta=True)
def upsample_nearest3d(x, output_size, scales_d=None, scales_h=None, scales_w=None, *, meta=None):
    return _upsample_nearest(x, output_size, [scales_d, scales_h, scales_w], False, _shortcuts(meta, output_size))


@register(aten._upsample_nearest_exact1d.default)
def upsample_nearest_exact1d(x, output_size, scales=None):
    return _upsample_nearest(x, output_size, [scales], exact=True)


@register(aten._upsample_nearest_exact2d.default)
def upsample_nearest_exact2d(x, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest(x, output_size, [scales_h, scales_w], exact=True)


@register(aten._upsample_nearest_exact3d.default)
def upsample_nearest_exact3d(x, output_size, scales_d=None, scales_h=None, scales_w=None):
    return _upsample_nearest(x, output_size, [scales_d, scales_h, scales_w], exact=True)


# -- linear, bilinear, trilinear (ATen's `compute_source_index_and_lambda`) -----------------------

def _linear_taps(in_size: int, out_size: int, align_corners: bool, scale: float | None):
    """(index0, index1, lambda0, lambda1) per output position."""
    i = np.arange(out_size)
    if out_size == in_size:  # copied: lambda (1, 0) on the same index, so an inf still gives NaN
        return i, i, np.ones(out_size, _f32), np.zeros(out_size, _f32)
    ratio = _area_scale(in_size, out_size, align_corners, scale)
    if align_corners:
        real = ratio * i.astype(_f32)
    else:  # `scale * (dst_index + 0.5) - 0.5`: in double (0.5 is a double), stored as float
        real = np.maximum((np.float64(ratio) * (i + 0.5) - 0.5).astype(_f32), _f32(0))
    index0 = np.minimum(np.floor(real).astype(np.int64), in_size - 1)
    lambda1 = np.clip(real - index0.astype(_f32), _f32(0), _f32(1))
    index1 = index0 + (index0 < in_size - 1)
    return index0, index1, _f32(1) - lambda1, lambda1


def _upsample_linear(x, output_size, align_corners, scales):
    # one dim at a time, the last first, as ATen's nested loops sum
    lead = x.ndim - len(output_size)
    for k in reversed(range(len(output_size))):
        axis = lead + k
        index0, index1, lambda0, lambda1 = _linear_taps(x.shape[axis], output_size[k], align_corners,
                                                        scales[k] if scales else None)
        shape = [1] * x.ndim
        shape[axis] = output_size[k]
        x = (jnp.take(x, jnp.asarray(index0), axis=axis) * jnp.asarray(lambda0).reshape(shape)
             + jnp.take(x, jnp.asarray(index1), axis=axis) * jnp.asarray(lambda1).reshape(shape))
    return x


@register(aten.upsample_linear1d.default)
@in_float32
def upsample_linear1d(x, output_size, align_corners, scales=None):
    return _upsample_linear(x, output_size, align_corners, [scales])


@register(aten.upsample_bilinear2d.default)
@in_float32
def upsample_bilinear2d(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_linear(x, output_size, align_corners, [scales_h, scales_w])


@register(aten.upsample_trilinear3d.default)
@in_float32
def upsample_trilinear3d(x, output_size, align_corners, scales_d=None, scales_h=None, scales_w=None):
    return _upsample_linear(x, output_size, align_corners, [scales_d, scales_h, scales_w])


@register(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
@in_float32
def upsample_linear_vec(x, output_size, align_corners, scale_factors):
    return _upsample_linear(x, _output_size(x, output_size, scale_factors), align_corners, scale_factors)


# torch.export's own table decomposes these (torch._decomp), which misses the kernels' rules above
keep_whole(aten.upsample_linear1d.default, aten.upsample_linear1d.vec, aten.upsample_bilinear2d.default,
           aten.upsample_trilinear3d.vec, aten.upsample_nearest1d.vec, aten.upsample_nearest3d.vec,
           aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact3d.vec)


# -- antialiased interpolation (ATen's UpSampleKernel.cpp, `_compute_indices_min_size_weights_aa`)

def _linear_filter(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, _f32(1) - x, _f32(0))


def _cubic_filter(x: np.ndarray) -> np.ndarray:
    # Keys' cubic convolution with a = -0.5, as Pillow (and torch with antialias=True)
    a = _f32(-0.5)
    x = np.abs(x)
    near = ((a + _f32(2)) * x - (a + _f32(3))) * x * x + _f32(1)
    far = ((a * x - _f32(5) * a) * x + _f32(8) * a) * x - _f32(4) * a
    return np.where(x < 1, near, np.where(x < 2, far, _f32(0)))


def _aa_taps(in_size: int, out_size: int, align_corners: bool, scale: float | None, interp_size: int,
             filter_fn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index, weight, used), each (out_size, taps): output i reads input index[i, j] with weight
    weight[i, j] for every j with used[i, j], in ATen's float32 arithmetic step by step (the C++
    mixes float and double: each `np.float64` below is a step ATen takes in double)."""
    scale = _area_scale(in_size, out_size, align_corners, scale)
    support = _f32(np.float64(interp_size * 0.5) * np.float64(scale)) if scale >= 1 else _f32(interp_size * 0.5)
    taps = int(np.ceil(support)) * 2 + 1
    invscale = _f32(1.0 / np.float64(scale)) if scale >= 1 else _f32(1)
    center = (np.float64(scale) * (np.arange(out_size) + 0.5)).astype(_f32)
    xmin = np.maximum(np.trunc((center - support).astype(np.float64) + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc((center + support).astype(np.float64) + 0.5), in_size).astype(np.int64)
    xsize = np.clip(xmax - xmin, 0, taps)
    j = np.arange(taps)
    index = xmin[:, None] + j
    distance = (index.astype(_f32) - center[:, None]).astype(np.float64) + 0.5
    weight = filter_fn((distance * np.float64(invscale)).astype(_f32))
    used = j < xsize[:, None]
    weight = np.where(used, weight, _f32(0))
    total = np.zeros(out_size, _f32)
    for k in range(taps):  # ATen sums the weights in order, in float32
        total = total + weight[:, k]
    weight = np.where(total[:, None] != 0, weight / np.where(total == 0, _f32(1), total)[:, None], weight)
    return np.minimum(index, in_size - 1), weight.astype(_f32), used


def _resample_axis(x, axis: int, index: np.ndarray, weight: np.ndarray, used: np.ndarray):
    """Each output position along `axis`: the weighted sum of the input positions it reads."""
    moved = jnp.moveaxis(x, axis, -1)
    taken = moved[..., jnp.asarray(index)]  # (..., out, taps)
    products = jnp.where(jnp.asarray(used), taken * jnp.asarray(weight), 0)
    return jnp.moveaxis(jnp.sum(products, axis=-1), -1, axis)


def _upsample_aa(x, output_size, align_corners, scales, interp_size, filter_fn):
    # separable, as ATen: the last dim first, then the one before; a dim whose size does not
    # change is left as it is (not resampled with unit weights)
    for axis in reversed(range(x.ndim - len(output_size), x.ndim)):
        in_size, out_size = x.shape[axis], output_size[axis - (x.ndim - len(output_size))]
        if in_size != out_size:
            scale = scales[axis - (x.ndim - len(output_size))]
            taps = _aa_taps(in_size, out_size, align_corners, scale, interp_size, filter_fn)
            x = _resample_axis(x, axis, *taps)
    return x


@register(aten._upsample_bilinear2d_aa.default)
@in_float32
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(x, output_size, align_corners, (scales_h, scales_w), 2, _linear_filter)


@register(aten._upsample_bicubic2d_aa.default)
@in_float32
def upsample_bicubic2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(x, output_size, align_corners, (scales_h, scales_w), 4, _cubic_filter)
