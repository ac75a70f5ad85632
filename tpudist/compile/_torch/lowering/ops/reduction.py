"""Reductions, softmax, sorting and order statistics (topk, kthvalue, median, mode). Sums, means,
variances and softmax of half-precision tensors accumulate in float32, as torch's kernels do."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, dim, dims, in_float32
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _accumulator(dtype):
    """The dtype a sum with `dtype=` accumulates in: float32 for half types, as torch's kernels do
    (the result is rounded to `dtype` once, by the interpreter)."""
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


@register(aten.sum.dim_IntList, aten.sum.default)
@in_float32
def sum_(x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=_accumulator(dtype))


@register(aten.mean.dim, aten.mean.default)
@in_float32
def mean(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=_accumulator(dtype))


@register(aten.prod.default)
@in_float32
def prod(x, dtype=None):
    return jnp.prod(x, dtype=_accumulator(dtype))


@register(aten.prod.dim_int)
@in_float32
def prod_dim(x, dim, keepdim=False, dtype=None):
    return jnp.prod(x, axis=dims(dim, x.ndim), keepdims=keepdim, dtype=_accumulator(dtype))


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
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = dim(d, x.ndim)
    index = arg(x, axis=d, keepdims=True)
    values = jnp.take_along_axis(x, index, axis=d)
    if not keepdim:
        values, index = jnp.squeeze(values, d), jnp.squeeze(index, d)
    return values, index


# jnp.argmax / argmin, as torch, take the first of tied extremes and treat NaN as the extreme
@register(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return _select_extreme(x, dim, keepdim, jnp.argmax)


@register(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return _select_extreme(x, dim, keepdim, jnp.argmin)


@register(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    if x.ndim == 0:
        return jnp.zeros((), jnp.int32)
    return jnp.argmax(x, axis=dim, keepdims=keepdim)


@register(aten.argmin.default)
def argmin(x, dim=None, keepdim=False):
    if x.ndim == 0:
        return jnp.zeros((), jnp.int32)
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
    return _vector_norm(x, float(ord), dims(dim, x.ndim), keepdim)


# torch 2.14's export table decomposes it to pow / sum / pow, whose gradient at a zero vector is NaN
keep_whole(aten.linalg_vector_norm.default)


@functools.partial(custom_vjp, nondiff_argnums=(1, 2, 3))
def _vector_norm(x, ord, axes, keepdim):
    """The `ord`-norm over `axes`, differentiated as torch's norm_backward: at zeros and ties the
    subgradient torch picks, where the root's derivative would be NaN or infinite."""
    a = jnp.abs(x)
    if ord == float("inf"):
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(a.dtype)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    return jnp.sum(a ** ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


def _vector_norm_fwd(x, ord, axes, keepdim):
    norm = _vector_norm(x, ord, axes, keepdim)
    return norm, (x, norm)


def _vector_norm_bwd(ord, axes, keepdim, residuals, g):
    x, norm = residuals
    if not keepdim:
        g, norm = jnp.expand_dims(g, axes), jnp.expand_dims(norm, axes)
    a = jnp.abs(x)
    sgn = x / jnp.where(a == 0, 1, a)  # torch's sgn: x / |x|, 0 at 0 (complex too)
    scale = jnp.where(norm == 0, 0, g / jnp.where(norm == 0, 1, norm) ** (ord - 1))
    if ord == 0:
        grad = jnp.zeros_like(x)
    elif ord == 1:
        grad = sgn * g
    elif ord == 2:
        grad = x * scale
    elif ord in (float("inf"), float("-inf")):
        # the gradient is shared among the entries at the extreme (and NaNs)
        mask = (a == norm) | jnp.isnan(a)
        grad = sgn * mask * (g / jnp.sum(mask, axis=axes, keepdims=True))
    elif ord < 1:
        grad = sgn * jnp.where(x == 0, 0, a ** (ord - 1)) * g * norm ** (1 - ord)
    elif ord < 2:
        grad = sgn * a ** (ord - 1) * scale
    else:
        grad = x * a ** (ord - 2) * scale
    return (jnp.conj(grad).astype(x.dtype),)  # (JAX's cotangent of a complex input is the conjugate of torch's)


_vector_norm.defvjp(_vector_norm_fwd, _vector_norm_bwd)


# -- sorting and order statistics ------------------------------------------------------------------
# torch orders NaN above every number and -0.0 equal to 0.0. Among equal values torch documents no
# order for sort(stable=False), topk and kthvalue (its CPU kernels use std::sort, std::nth_element
# and a quickselect; CUDA differs again); these lowerings take equal values in index order, which
# is what sort(stable=True) and median.dim promise.

def _rows(fn):
    """`fn(x, axis, ...)` applied to a 0-d tensor as to a 1-element row, results back at 0-d."""
    def wrapped(x, *args, **kwargs):
        if x.ndim:
            return fn(x, *args, **kwargs)
        return tuple(r.reshape(()) for r in fn(x[None], *args, **kwargs))
    return wrapped


@register(aten.sort.default, aten.sort.stable)
@_rows
def sort(x, dim=-1, descending=False, *, stable=False):
    # jnp.argsort orders as torch does: NaN last ascending and first descending, -0.0 == 0.0, and
    # (stable) equal values in index order in both directions
    index = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, index, axis=dim), index


def _order_key(x):
    """Integers ordered as torch compares `x`: NaN above +inf, -0.0 equal to 0.0."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    f = x.astype(jnp.float32)
    f = jnp.where(jnp.isnan(f), jnp.float32(jnp.nan), jnp.where(f == 0, jnp.float32(0), f))
    bits = lax.bitcast_convert_type(f, jnp.int32)
    # negative floats: flip the magnitude bits, so larger magnitudes order lower
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


@register(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)  # torch returns the element for k = 0 as for k = 1
    d = dim % x.ndim
    moved = jnp.moveaxis(x, d, -1)
    key = _order_key(moved)
    # bitwise not reverses an integer order exactly (negation would overflow at the minimum)
    _, index = lax.top_k(key if largest else ~key, k)
    values = jnp.take_along_axis(moved, index, axis=-1)  # re-read, so the gradient flows to x
    return jnp.moveaxis(values, -1, d), jnp.moveaxis(index, -1, d)


def _pick(x, d, position, keepdim, index=None):
    """The element at `position` (per row, a place in `x`'s stable sorted order along `d`) and its
    index, unless `index` (keepdims) is given; the value is read back at the index, so the
    gradient reaches that one element, as torch's value-selecting backward does."""
    if index is None:
        order = jnp.argsort(x, axis=d, stable=True)
        index = jnp.take_along_axis(order, jnp.expand_dims(position, d), axis=d)
    values = jnp.take_along_axis(x, index, axis=d)
    if not keepdim:
        values, index = jnp.squeeze(values, d), jnp.squeeze(index, d)
    return values, index


@register(aten.kthvalue.default)
@_rows
def kthvalue(x, k, dim=-1, keepdim=False):
    d = dim % x.ndim
    return _pick(x, d, jnp.full(x.shape[:d] + x.shape[d + 1:], k - 1, jnp.int32), keepdim)


def _median_position(x, d, ignore_nan):
    """Where torch's median sits in the stable sorted order: the lower middle, among the
    non-NaN values for nanmedian (0 when all are NaN)."""
    n = x.shape[d]
    if not ignore_nan:
        return jnp.full(x.shape[:d] + x.shape[d + 1:], (n - 1) // 2, jnp.int32)
    count = jnp.sum(~jnp.isnan(x), axis=d, dtype=jnp.int32)
    return jnp.maximum(count - 1, 0) // 2


@register(aten.median.dim)
@_rows
def median_dim(x, dim, keepdim=False):
    d = dim % x.ndim
    order = jnp.argsort(x, axis=d, stable=True)
    index = jnp.take_along_axis(order, jnp.expand_dims(_median_position(x, d, False), d), axis=d)
    if jnp.issubdtype(x.dtype, jnp.floating):
        # a row holding NaN has median NaN, at its first NaN
        nan = jnp.isnan(x)
        index = jnp.where(jnp.any(nan, axis=d, keepdims=True), jnp.argmax(nan, axis=d, keepdims=True), index)
    return _pick(x, d, None, keepdim, index)


@register(aten.nanmedian.dim)
@_rows
def nanmedian_dim(x, dim, keepdim=False):
    d = dim % x.ndim
    return _pick(x, d, _median_position(x, d, jnp.issubdtype(x.dtype, jnp.floating)), keepdim)


@jax.custom_jvp
def _spread(x, value):
    """`value`, one of x's elements; differentiated as torch's `evenly_distribute_backward`: the
    gradient is shared equally by every element equal to it (every NaN, when it is NaN)."""
    return value


@_spread.defjvp
def _spread_jvp(primals, tangents):
    x, value = primals
    mask = jnp.where(jnp.isnan(value), jnp.isnan(x), x == value)
    return value, jnp.sum(jnp.where(mask, tangents[0], 0)) / jnp.sum(mask).astype(value.dtype)


def _median_all(x, ignore_nan):
    flat = x.reshape(-1)
    ignore_nan = ignore_nan and jnp.issubdtype(x.dtype, jnp.floating)
    value = jnp.sort(flat)[_median_position(flat, 0, ignore_nan)]
    if jnp.issubdtype(x.dtype, jnp.floating):
        if not ignore_nan:
            value = jnp.where(jnp.any(jnp.isnan(flat)), jnp.nan, value)
        return _spread(flat, lax.stop_gradient(value))
    return value


@register(aten.median.default)
def median(x):
    return _median_all(x, False)


@register(aten.nanmedian.default)
def nanmedian(x):
    return _median_all(x, True)


@register(aten.mode.default)
@_rows
def mode(x, dim=-1, keepdim=False):
    """The most frequent value, the smallest of equally frequent ones, and the last index holding
    it: torch's CPU kernel (a sort of the row, then its longest run; for rows of more than 16
    elements its sort is not stable, and which index of the value it returns is not specified)."""
    d = dim % x.ndim
    moved = jnp.moveaxis(x, d, -1)
    order = jnp.argsort(moved, axis=-1, stable=True)
    ordered = jnp.take_along_axis(moved, order, axis=-1)
    n = moved.shape[-1]
    position = jnp.arange(n)
    starts = jnp.concatenate([jnp.ones_like(ordered[..., :1], bool), ordered[..., 1:] != ordered[..., :-1]], -1)
    ends = jnp.concatenate([starts[..., 1:], jnp.ones_like(starts[..., :1])], -1)
    run = position - lax.cummax(jnp.where(starts, position, 0), axis=moved.ndim - 1) + 1
    last = jnp.argmax(jnp.where(ends, run, 0), axis=-1, keepdims=True)  # first longest run
    index = jnp.take_along_axis(order, last, axis=-1)
    values = jnp.take_along_axis(moved, index, axis=-1)
    values, index = jnp.moveaxis(values, -1, d), jnp.moveaxis(index, -1, d)
    if not keepdim:
        values, index = jnp.squeeze(values, d), jnp.squeeze(index, d)
    return values, index
