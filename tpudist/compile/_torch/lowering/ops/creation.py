"""Tensor factories: full / zeros / ones / arange / scalar_tensor and their `_like` forms.

A `dtype=None` resolves as in torch when the interpreter casts the result to the dtype torch
recorded for the node, so the factories only need a sensible default here.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


@register(aten.full.default)
def full(size, fill_value, *, dtype=None):
    return jnp.full(tuple(size), fill_value, dtype)


@register(aten.full_like.default)
def full_like(x, fill_value, *, dtype=None):
    return jnp.full(x.shape, fill_value, dtype or x.dtype)


@register(aten.new_full.default)
def new_full(x, size, fill_value, *, dtype=None):
    return jnp.full(tuple(size), fill_value, dtype or x.dtype)


@register(aten.zeros.default, aten.empty.memory_format, aten.empty_strided.default)
def zeros(size, stride=None, *, dtype=None):
    # an uninitialized tensor may hold anything; zeros is the deterministic choice
    return jnp.zeros(tuple(size), dtype or jnp.float32)


@register(aten.ones.default)
def ones(size, *, dtype=None):
    return jnp.ones(tuple(size), dtype or jnp.float32)


@register(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None):
    # the physical layout is torch's memory order; values are what matters here
    return jnp.zeros(tuple(size), dtype or jnp.float32)


@register(aten.zeros_like.default, aten.empty_like.default)
def zeros_like(x, *, dtype=None):
    return jnp.zeros(x.shape, dtype or x.dtype)


@register(aten.ones_like.default)
def ones_like(x, *, dtype=None):
    return jnp.ones(x.shape, dtype or x.dtype)


@register(aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default)
def new_zeros(x, size, stride=None, *, dtype=None):
    return jnp.zeros(tuple(size), dtype or x.dtype)


@register(aten.new_ones.default)
def new_ones(x, size, *, dtype=None):
    return jnp.ones(tuple(size), dtype or x.dtype)


@register(aten.arange.default)
def arange(end, *, dtype=None):
    return jnp.arange(end, dtype=dtype)


@register(aten.arange.start, aten.arange.start_step)
def arange_start(start, end, step=1, *, dtype=None):
    return jnp.arange(start, end, step, dtype=dtype)


@register(aten.scalar_tensor.default)
def scalar_tensor(value, *, dtype=None):
    return jnp.asarray(value, dtype or jnp.float32)
