"""Indexing: advanced indexing and index_put, gather / scatter and their reductions (scatter_reduce,
index_reduce), take-like and masked writes (put, masked_scatter, diagonal / as_strided scatter),
nonzero_static. Embedding and EmbeddingBag: ops/embedding.py."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from tpudist.compile._torch.lowering._table import UnsupportedOpError, register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, dim as norm_dim, unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


@register(aten.index.Tensor)
def index(x, indices):
    # torch follows NumPy's advanced-indexing rules, as JAX does, including where the
    # broadcast index dims land when index tensors are separated by a slice
    return x[_index_tuple(indices)]


def _is_mask(i):
    # torch reads uint8 index tensors as masks too (deprecated, but still so)
    return i is not None and i.dtype in (jnp.bool_, jnp.uint8)


@register(aten.index_put.default)
def index_put(x, indices, values, accumulate=False):
    indices = list(indices)
    masks = [p for p, i in enumerate(indices) if _is_mask(i)]
    if not masks:
        if accumulate:
            return x.at[_index_tuple(indices)].add(values)
        return _set_at(x, indices, values)
    p = masks[0]
    if len(masks) > 1 or any(i is not None for i in indices[p + 1:] + indices[:p]) or indices[p].ndim == 0:
        raise unsupported_arg("aten.index_put", "a boolean mask together with other index tensors (its number "
                              "of True entries is data-dependent); write x = torch.where(mask, value, x)")
    return _put_masked(x, p, indices[p].astype(bool), values, accumulate)


def _set_at(x, indices, values):
    """`x.at[indices].set(values)` (indices: index arrays, None for a whole dim), differentiated as
    torch's index_put / scatter / put: each entry of values gets the gradient of the position it
    names, duplicates included (JAX's own rule gives it to the one write that lands)."""
    values = jnp.asarray(values, x.dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x.at[_index_tuple(indices)].set(values)
    present = tuple(i is not None for i in indices)
    arrays = [i for i in indices if i is not None]
    if present.count(True) == 1 and 1 in x.shape[:present.index(True)]:
        return _set_row(x, present.index(True), arrays[0], values)
    return _set_at_vjp(present, x, arrays, values)


def _set_row(x, p, index, values):
    """x[:, ..., index] = values along dim p, with x's dims of size 1 before p dropped for the
    write: XLA drops them from the dots that read the result (attention reading a batch-1 KV
    cache), and a write in that shape is one XLA:CPU updates in place and fuses once (through a
    reshape, its fusion duplicates the write and copy insertion adds copies of the array)."""
    kept = [d for d in range(p) if x.shape[d] != 1]
    shape = x.shape[:p] + index.shape + x.shape[p + 1:]
    values = jnp.broadcast_to(values, shape).reshape(*(shape[d] for d in kept), *shape[p:])
    written = _set_at_vjp((False,) * len(kept) + (True,), x.reshape(*(x.shape[d] for d in kept), *x.shape[p:]),
                          [index], values)
    return written.reshape(x.shape)


def _where(present, arrays):
    arrays = iter(arrays)
    return tuple(next(arrays) if p else slice(None) for p in present)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _set_at_vjp(present, x, arrays, values):
    return x.at[_where(present, arrays)].set(values)


def _set_at_fwd(present, x, arrays, values):
    return _set_at_vjp(present, x, arrays, values), (arrays, values)


def _set_at_bwd(present, saved, g):
    arrays, values = saved
    where = _where(present, arrays)
    written = g[where]
    # sum the gradient over the dims that values was broadcast along
    lead = written.ndim - values.ndim
    written = jnp.sum(written, axis=tuple(range(lead)))
    broadcast = tuple(d for d, n in enumerate(values.shape) if n == 1 and written.shape[d] != 1)
    return g.at[where].set(0), None, jnp.sum(written, axis=broadcast, keepdims=True).reshape(values.shape)


_set_at_vjp.defvjp(_set_at_fwd, _set_at_bwd)


def _put_masked(x, p, mask, values, accumulate):
    """x[:, ..., mask] = values (or +=), the mask covering dims p.. of x: a select, not a scatter.
    `values` broadcasts against x[..., mask] (count, *rest), whose count is data-dependent: values
    either repeat along it (size 1) or hold one entry per True element, in order."""
    k = mask.ndim
    head, rest = x.shape[:p], x.shape[p + k:]
    values = jnp.asarray(values, x.dtype)
    count_axis = values.ndim - len(rest) - 1
    per_element = count_axis >= 0 and values.shape[count_axis] != 1
    count = values.shape[count_axis] if per_element else 1
    values = jnp.broadcast_to(values, head + (count,) + rest)
    if per_element:
        # the i-th True element (in row-major order) takes the i-th entry
        rank = jnp.cumsum(mask.reshape(-1)) - 1
        full = jnp.take(values, jnp.clip(rank, 0, count - 1).reshape(mask.shape), axis=p)
    else:
        full = values.reshape(head + (1,) * k + rest)
    where = mask.reshape((1,) * p + mask.shape + (1,) * len(rest))
    if accumulate:
        return x + jnp.where(where, full, jnp.zeros((), x.dtype))
    return jnp.where(where, full, x)


@register(aten.index_select.default)
def index_select(x, dim, index):
    if x.ndim == 0:
        return jnp.take(x.reshape(1), index.reshape(-1), axis=0).reshape(())
    return jnp.take(x, index.reshape(-1), axis=norm_dim(dim, x.ndim))


# -- gather / scatter ------------------------------------------------------------------------------

def _scatter_index(index, dim):
    """The full index tuple that addresses, along `dim`, the positions `index` names."""
    grids = jnp.meshgrid(*[jnp.arange(s) for s in index.shape], indexing="ij")
    return tuple(index if d == dim else grids[d] for d in range(index.ndim))


def _slices_index(shape, dim, index):
    """The full index tuple of index_add / index_reduce: slice i along `dim` goes to index[i]."""
    grids = jnp.meshgrid(*[jnp.arange(s) for s in shape], indexing="ij")
    along = index.reshape((1,) * dim + (-1,) + (1,) * (len(shape) - dim - 1))
    return tuple(jnp.broadcast_to(along, shape) if d == dim else grids[d] for d in range(len(shape)))


def _fit(src, index):
    # torch reads src only where index has entries; src may be larger in every dim
    return src[tuple(slice(0, s) for s in index.shape)]


def _one_d(fn):
    """Runs a scatter-like lowering of a 0-d self on 1-element tensors (torch treats them so)."""
    @functools.wraps(fn)
    def wrapped(x, dim, index, src, *args, **kwargs):
        if x.ndim:
            return fn(x, dim, index, src, *args, **kwargs)
        src = jnp.reshape(src, (-1,)) if hasattr(src, "shape") else src
        return fn(x.reshape(1), 0, index.reshape(-1), src, *args, **kwargs).reshape(())
    return wrapped


@register(aten.gather.default)
def gather(x, dim, index, *, sparse_grad=False):
    if index.ndim == 0:
        return x[()] if x.ndim == 0 else jnp.take(x, index, axis=0)
    d = norm_dim(dim, x.ndim)
    return x[_scatter_index(index, d)]


@register(aten.scatter.src, aten.scatter.value)
@_one_d
def scatter(x, dim, index, src):
    where = _scatter_index(index, norm_dim(dim, x.ndim))
    if hasattr(src, "shape") and jnp.ndim(src):
        return _set_at(x, list(where), _fit(src, index))
    return x.at[where].set(src)


@register(aten.scatter_add.default)
@_one_d
def scatter_add(x, dim, index, src):
    return x.at[_scatter_index(index, norm_dim(dim, x.ndim))].add(_fit(src, index))


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _no_gradient(op, x):
    return x


def _no_gradient_fwd(op, x):
    return x, None


def _no_gradient_bwd(op, _, g):
    raise UnsupportedOpError(f"torch -> XLA: {op} has no gradient (in torch neither: 'derivative for "
                             "aten::scatter is not implemented'); use scatter_add / scatter_reduce")


_no_gradient.defvjp(_no_gradient_fwd, _no_gradient_bwd)


@register(aten.scatter.reduce, aten.scatter.value_reduce)
@_one_d
def scatter_with_reduce(x, dim, index, src, *, reduce):
    where = _scatter_index(index, norm_dim(dim, x.ndim))
    src = _fit(src, index) if jnp.ndim(src) else jnp.asarray(src, x.dtype)
    if reduce not in ("add", "multiply"):
        raise unsupported_arg("aten.scatter", f"reduce={reduce!r}")
    at = x.at[where]
    out = at.add(src) if reduce == "add" else at.multiply(src)
    return _no_gradient(f"aten.scatter with reduce={reduce!r}", out)


def _identity(reduce, dtype):
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce == "amin")
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


def _reduce_into(x, where, src, reduce, include_self):
    """x with src reduced into it at `where` (a full index tuple shaped as src), as torch's
    scatter_reduce / index_reduce with `reduce` in prod / amax / amin."""
    base = x if include_self else x.at[where].set(_identity(reduce, x.dtype))
    at = base.at[where]
    return {"prod": at.multiply, "amax": at.max, "amin": at.min}[reduce](src)


@functools.partial(custom_vjp, nondiff_argnums=(3, 4))
def _reduce_into_vjp(x, where, src, reduce, include_self):
    return _reduce_into(x, where, src, reduce, include_self)


def _reduce_into_fwd(x, where, src, reduce, include_self):
    result = _reduce_into(x, where, src, reduce, include_self)
    return result, (x, where, src, result)


def _reduce_into_bwd(reduce, include_self, saved, g):
    """torch's scatter_reduce_backward / index_reduce_backward (torch/csrc/autograd/
    FunctionsManual.cpp), formula for formula: their tie and zero conventions are torch's."""
    x, where, src, result = saved
    if reduce == "prod":
        masked_self = jnp.where(x == 0, jnp.ones((), x.dtype), x)
        grad_self = g * _reduce_into(masked_self, where, src, reduce, include_self) / masked_self
        src_zero = src == 0
        zeros = jnp.zeros(x.shape, x.dtype).at[where].add(src_zero.astype(x.dtype))[where]
        single = src_zero & (zeros == 1)
        masked_src_result = _reduce_into(x, where, jnp.where(single, jnp.ones((), src.dtype), src), reduce,
                                         include_self)
        grad_src = jnp.where(single, (g * masked_src_result)[where],
                             (g * result)[where] / jnp.where(src_zero, jnp.ones((), src.dtype), src))
    else:  # amax / amin: shared evenly by the elements equal to the result
        self_is = (x == result).astype(x.dtype)
        src_is = (src == result[where]).astype(x.dtype)
        share = g / self_is.at[where].add(src_is)
        grad_self, grad_src = self_is * share, src_is * share[where]
    if not include_self:
        grad_self = grad_self.at[where].set(0)
    return grad_self, None, grad_src


_reduce_into_vjp.defvjp(_reduce_into_fwd, _reduce_into_bwd)


def _reduce(x, where, src, reduce, include_self, op):
    if reduce in ("sum", "mean"):
        base = x if include_self else x.at[where].set(0)
        total = base.at[where].add(src)
        if reduce == "sum":
            return total
        counts = jnp.zeros(x.shape, jnp.int32).at[where].add(1) + (1 if include_self else 0)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return total / jnp.maximum(counts, 1).astype(total.dtype)
        return jnp.floor_divide(total, jnp.maximum(counts, 1).astype(total.dtype))
    if reduce not in ("prod", "amax", "amin"):
        raise unsupported_arg(op, f"reduce={reduce!r}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return _reduce_into(x, where, src, reduce, include_self)
    return _reduce_into_vjp(x, where, src, reduce, include_self)


@register(aten.scatter_reduce.two)
@_one_d
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    where = _scatter_index(index, norm_dim(dim, x.ndim))
    return _reduce(x, where, _fit(src, index), reduce, include_self, "aten.scatter_reduce")


@register(aten.index_reduce.default)
@_one_d
def index_reduce(x, dim, index, src, reduce, *, include_self=True):
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise unsupported_arg("aten.index_reduce", f"reduce={reduce!r}")
    where = _slices_index(src.shape, norm_dim(dim, x.ndim), index.reshape(-1))
    return _reduce(x, where, src, reduce, include_self, "aten.index_reduce")


# -- writes addressed otherwise --------------------------------------------------------------------

@register(aten.put.default)
def put(x, index, source, accumulate=False):
    # torch.put indexes x as if flattened; negative indices count from the end, as in JAX
    flat, where = x.reshape(-1), index.reshape(-1)
    if accumulate:
        return flat.at[where].add(source.reshape(-1)).reshape(x.shape)
    return _set_at(flat, [where], source.reshape(-1)).reshape(x.shape)


@register(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    """x with the positions where `mask` (broadcast to x) holds taking source's elements in order."""
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    mask = jnp.broadcast_to(mask, shape).reshape(-1)
    rank = jnp.clip(jnp.cumsum(mask) - 1, 0, max(source.size - 1, 0))
    taken = jnp.take(source.reshape(-1), rank) if source.size else jnp.zeros(mask.shape, x.dtype)
    return jnp.where(mask, taken, jnp.broadcast_to(x, shape).reshape(-1)).reshape(shape)


@register(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = norm_dim(dim1, x.ndim), norm_dim(dim2, x.ndim)
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    n = src.shape[-1]  # torch's diagonal puts the diagonal last
    rows = jnp.arange(n) + max(-offset, 0)
    cols = jnp.arange(n) + max(offset, 0)
    return jnp.moveaxis(moved.at[..., rows, cols].set(src), (-2, -1), (d1, d2))


def _storage_positions(shape, stride, offset):
    grids = [np.arange(n).reshape((-1,) + (1,) * (len(shape) - 1 - i)) * s
             for i, (n, s) in enumerate(zip(shape, stride))]
    return np.broadcast_to(offset + sum(grids, np.zeros((), np.int64)), tuple(shape)).reshape(-1)


@register(aten.as_strided_scatter.default, input_meta=True)
def as_strided_scatter(x, src, size, stride, storage_offset=None, *, meta):
    """torch's `out = x.clone(); out.as_strided(size, stride, offset).copy_(src)`: the clone keeps
    x's strides when they are dense (else it is contiguous), at storage offset 0."""
    positions = _storage_positions(x.shape, meta.stride(), 0)
    if not np.array_equal(np.sort(positions), np.arange(positions.size)):
        positions = np.arange(positions.size)
    element = np.empty(positions.size, np.int64)
    element[positions] = np.arange(positions.size)
    wanted = _storage_positions(size, stride, storage_offset or 0)
    if wanted.size and (wanted.max() >= positions.size or wanted.min() < 0
                        or np.unique(wanted).size != wanted.size):
        raise unsupported_arg("aten.as_strided_scatter", f"a view {tuple(size)} with strides {tuple(stride)} that "
                              f"overlaps itself or leaves x's {tuple(x.shape)} storage")
    flat = x.reshape(-1).at[jnp.asarray(element[wanted], jnp.int32)].set(src.reshape(-1))
    return flat.reshape(x.shape)


@register(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int32)
    return jnp.stack(jnp.nonzero(x, size=size, fill_value=fill_value), axis=1).reshape(size, x.ndim)
