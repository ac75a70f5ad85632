"""Reductions, scans, softmax, sorting. Sums, means, variances and softmax of half-precision
tensors accumulate in float32, as torch's kernels do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch._registry import register
from tpudist.compile._torch.ops._util import dim, dims, in_float32, unsupported_arg

aten = __import__("torch").ops.aten


@register(aten.sum.dim_IntList, aten.sum.default)
@in_float32
def sum_(x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@register(aten.mean.dim, aten.mean.default)
@in_float32
def mean(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@register(aten.prod.default)
def prod(x, dtype=None):
    return jnp.prod(x, dtype=dtype)


@register(aten.prod.dim_int)
def prod_dim(x, dim, keepdim=False, dtype=None):
    return jnp.prod(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@register(aten.amax.default)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=dims(dim, x.ndim), keepdims=keepdim)


@register(aten.amin.default)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=dims(dim, x.ndim), keepdims=keepdim)


@register(aten.max.default)
def max_(x):
    return jnp.max(x)


@register(aten.min.default)
def min_(x):
    return jnp.min(x)


def _select_extreme(x, d, keepdim, arg):
    # the value is read back at the chosen index, so the gradient reaches only that element,
    # as torch's max.dim / min.dim backward does (amax spreads it over ties instead)
    d = dim(d, x.ndim)
    index = arg(x, axis=d, keepdims=True)
    values = jnp.take_along_axis(x, index, axis=d)
    if not keepdim:
        values, index = jnp.squeeze(values, d), jnp.squeeze(index, d)
    return values, index


@register(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return _select_extreme(x, dim, keepdim, jnp.argmax)


@register(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return _select_extreme(x, dim, keepdim, jnp.argmin)


@register(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    return jnp.argmax(x, axis=dim, keepdims=keepdim)


@register(aten.argmin.default)
def argmin(x, dim=None, keepdim=False):
    return jnp.argmin(x, axis=dim, keepdims=keepdim)


def _var(x, dim, correction, keepdim):
    axes = dims(dim, x.ndim)
    n = 1
    for a in axes:
        n *= x.shape[a]
    correction = 1 if correction is None else correction
    centered = x - jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.sum(centered * centered, axis=axes, keepdims=keepdim) / max(n - correction, 0)
    return var, axes


@register(aten.var.correction)
@in_float32
def var(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction, keepdim)[0]


@register(aten.var_mean.correction)
@in_float32
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    v, axes = _var(x, dim, correction, keepdim)
    return v, jnp.mean(x, axis=axes, keepdims=keepdim)


def _logic(op, fn):
    register(*op)(lambda x, dim=None, keepdim=False: fn(x, axis=dims(dim, x.ndim), keepdims=keepdim))


_logic((aten.any.default, aten.any.dim, aten.any.dims), jnp.any)
_logic((aten.all.default, aten.all.dim, aten.all.dims), jnp.all)


@register(aten.cumsum.default)
@in_float32
def cumsum(x, dim, dtype=None):
    return jnp.cumsum(x, axis=dim, dtype=dtype)


@register(aten.cumprod.default)
def cumprod(x, dim, dtype=None):
    return jnp.cumprod(x, axis=dim, dtype=dtype)


@register(aten.logsumexp.default)
@in_float32
def logsumexp(x, dim, keepdim=False):
    return jax.nn.logsumexp(x, axis=dims(dim, x.ndim), keepdims=keepdim)


@register(aten._softmax.default)
@in_float32
def softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(x, axis=dim)


@register(aten._log_softmax.default)
@in_float32
def log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(x, axis=dim)


@register(aten.linalg_vector_norm.default)
@in_float32
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    axes = dims(dim, x.ndim)
    a = jnp.abs(x)
    if ord == float("inf"):
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(x.dtype)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    total = jnp.sum(a ** ord, axis=axes, keepdims=keepdim)
    # torch's gradient of a norm at zero is zero; the plain root's would be NaN
    nonzero = total > 0
    return jnp.where(nonzero, jnp.where(nonzero, total, 1) ** (1.0 / ord), 0)


@register(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    d = dim % x.ndim
    moved = jnp.moveaxis(x, d, -1)
    values, index = lax.top_k(moved if largest else -moved, k)
    values = jnp.take_along_axis(moved, index, axis=-1)  # re-read, so the gradient flows to x
    return jnp.moveaxis(values, -1, d), jnp.moveaxis(index, -1, d)


@register(aten.sort.default, aten.sort.stable)
def sort(x, dim=-1, descending=False, *, stable=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    key = -x if descending else x
    if descending and not jnp.issubdtype(x.dtype, jnp.floating) and not jnp.issubdtype(x.dtype, jnp.signedinteger):
        raise unsupported_arg("aten.sort", f"descending=True on dtype {x.dtype}")
    index = jnp.argsort(key, axis=dim, stable=True)
    return jnp.take_along_axis(x, index, axis=dim), index
