"""Grid sampling: F.grid_sample (aten.grid_sampler_2d / 3d) in every interpolation and padding
mode torch's CPU kernels have, with the gradients JAX derives from them.

Tap positions and weights are those of ATen's kernels (GridSamplerKernel.cpp for 2-d,
GridSampler.cpp for 3-d), computed in the same float32 steps, and taps that fall outside the input
are left out rather than multiplied by zero, so an inf or NaN in the input spreads exactly as far
as in torch.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import in_float32, unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


_f32 = np.float32


_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size: int, align_corners: bool, nd: int):
    """A grid coordinate in [-1, 1] -> an input position, rounded as ATen's kernel for `nd` dims
    rounds it (the vectorized 2-d kernel and the scalar 3-d one group the arithmetic differently)."""
    if nd == 2:
        if align_corners:
            return (coord + 1) * _f32((size - 1) / 2)
        return (coord + 1) * _f32(size / 2) - _f32(0.5)
    if align_corners:
        return ((coord + 1) / 2) * _f32(size - 1)
    return ((coord + 1) * _f32(size) - 1) / 2


def _clip(u, size: int):
    """Clamped to [0, size - 1]; the gradient is 1 strictly inside and 0 on the borders and beyond,
    as ATen's `clip_coordinates_set_grad`."""
    inside = (u > 0) & (u < size - 1)
    return jnp.where(inside, u, jnp.clip(lax.stop_gradient(u), 0, size - 1))


def _reflect(u, size: int, align_corners: bool):
    """Reflected off the borders (pixel centers with align_corners, else pixel edges) until
    inside; the gradient is +-1 by the parity of the reflections, as ATen's."""
    twice_span = 2 * (size - 1) if align_corners else 2 * size
    if twice_span == 0:
        return jnp.zeros_like(u)
    low = _f32(0 if align_corners else -0.5)
    shifted = lax.stop_gradient(u) - low
    magnitude = jnp.abs(shifted)
    extra = magnitude - jnp.trunc(magnitude / twice_span) * twice_span
    flipped = twice_span - extra
    one_more = extra > flipped
    value = jnp.where(one_more, flipped, extra) + low
    sign = jnp.where(one_more ^ (shifted < 0), -1, 1).astype(u.dtype)
    return value + sign * (u - lax.stop_gradient(u))


def _pad(u, size: int, padding: int, align_corners: bool):
    if padding == _BORDER:
        return _clip(u, size)
    if padding == _REFLECTION:
        return _clip(_reflect(u, size, align_corners), size)
    return u


def _cubic_coefficients(t):
    # ATen's bicubic (non-antialiased) convolution, a = -0.75, for taps at -1, 0, 1, 2
    a = _f32(-0.75)

    def near(s):
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _inside(p, size: int):
    return (p >= 0) & (p <= size - 1)


def _sample(x, taps):
    """x (N, C, *in) read at every combination of the per-dim taps (position, weight, valid) and
    summed with the product of their weights; a tap outside the input reads 0 (no product with it).
    One gather for all combinations (2**nd, or 16 for bicubic)."""
    n, c, *sizes = x.shape
    flats, valids, weights = [], [], []
    for combo in itertools.product(*taps):
        flat, valid, weight = 0, True, None
        for (position, w, ok), size in zip(combo, sizes):
            flat = flat * size + jnp.clip(position, 0, size - 1).astype(jnp.int32)
            valid = valid & ok
            weight = w if weight is None else (weight if w is None else weight * w)
        flats.append(flat)
        valids.append(valid)
        weights.append(weight)
    flat, valid = jnp.stack(flats, -1), jnp.stack(valids, -1)[:, None]
    values = jnp.take_along_axis(x.reshape(n, c, -1), flat.reshape(n, 1, -1), axis=2).reshape((n, c) + flat.shape[1:])
    values = jnp.where(valid, values, 0)
    if weights[0] is None:
        return values[..., 0]
    return jnp.sum(values * jnp.stack(weights, -1)[:, None], axis=-1)


def _grid_sample(x, grid, mode: int, padding: int, align_corners: bool):
    nd = x.ndim - 2
    sizes = x.shape[2:]
    # grid's last dim is (x, y[, z]): x indexes the last spatial dim
    coords = [_unnormalize(grid[..., nd - 1 - k], sizes[k], align_corners, nd) for k in range(nd)]
    taps = []
    for u, size in zip(coords, sizes):
        if mode == _BICUBIC:
            base = jnp.floor(lax.stop_gradient(u))
            weights = _cubic_coefficients(u - base)
            positions = [_pad(base + offset, size, padding, align_corners) for offset in (-1, 0, 1, 2)]
            taps.append([(jnp.floor(p), w, _inside(jnp.floor(p), size))
                         for p, w in zip(positions, weights)])
            continue
        u = _pad(u, size, padding, align_corners)
        if mode == _NEAREST:
            p = jnp.round(lax.stop_gradient(u))  # half to even, as ATen's nearbyint
            taps.append([(p, None, _inside(p, size))])
            continue
        base = jnp.floor(lax.stop_gradient(u))
        frac = u - base
        taps.append([(base, 1 - frac, _inside(base, size)), (base + 1, frac, _inside(base + 1, size))])
    return _sample(x, taps)


@register(aten.grid_sampler_2d.default)
@in_float32
def grid_sampler_2d(x, grid, interpolation_mode, padding_mode, align_corners):
    _check_modes("aten.grid_sampler_2d", interpolation_mode, padding_mode, (_BILINEAR, _NEAREST, _BICUBIC))
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_3d.default)
@in_float32
def grid_sampler_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    _check_modes("aten.grid_sampler_3d", interpolation_mode, padding_mode, (_BILINEAR, _NEAREST))
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


def _check_modes(op: str, mode: int, padding: int, modes: tuple[int, ...]) -> None:
    if mode not in modes:
        raise unsupported_arg(op, f"interpolation_mode={mode} (torch's kernel has none for it)")
    if padding not in (_ZEROS, _BORDER, _REFLECTION):
        raise unsupported_arg(op, f"padding_mode={padding}")
