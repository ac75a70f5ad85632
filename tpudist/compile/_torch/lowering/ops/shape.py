"""Views and layout: view / reshape / permute / expand / squeeze / cat / split / slice / pad.

With static shapes every view is a value-level reshape or slice; strides and storage sharing do
not exist on the JAX side (the captured graph is functional). `as_strided`, which torch's own
decompositions emit (mean over a channels-last tensor, unfold), is lowered from the strides torch
recorded for its input: the input's values are laid out in its storage order, and the view's
elements read back from there (a reshape when they are in order, else one gather of static
indices).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist.compile._torch.lowering._table import UnsupportedOpError, decompose_with_torch, register
from tpudist.compile._torch.lowering.ops._util import dim
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(x, size):
    return jnp.reshape(x, tuple(size))


@register(aten.permute.default)
def permute(x, dims):
    return jnp.transpose(x, tuple(dims))


@register(aten.t.default)
def t(x):
    return x.T


@register(aten.transpose.int)
def transpose(x, dim0, dim1):
    return jnp.swapaxes(x, dim0, dim1)


@register(aten.expand.default)
def expand(x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@register(aten.unsqueeze.default)
def unsqueeze(x, d):
    return jnp.expand_dims(x, d % (x.ndim + 1))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(x, dims=None):
    if x.ndim == 0:
        return x
    if dims is None:
        dims = range(x.ndim)
    elif isinstance(dims, int):
        dims = [dims]
    # torch silently keeps dims whose size is not 1
    return jnp.squeeze(x, tuple(d % x.ndim for d in dims if x.shape[d % x.ndim] == 1))


@register(aten.cat.default)
def cat(tensors, dim=0):
    # torch still accepts legacy empty 1-d tensors of any rank mismatch in cat; they add nothing
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    return jnp.concatenate(tensors, axis=dim % tensors[0].ndim)


@register(aten.split_with_sizes.default)
def split_with_sizes(x, split_sizes, dim=0):
    d = dim % x.ndim
    cuts = list(itertools.accumulate(split_sizes))[:-1]
    return jnp.split(x, cuts, axis=d)


@register(aten.split.Tensor)
def split(x, split_size, dim=0):
    n = x.shape[dim % x.ndim]
    return split_with_sizes(x, [min(split_size, n - i) for i in range(0, n, split_size)] or [0], dim)


@register(aten.unbind.int)
def unbind(x, dim=0):
    d = dim % x.ndim
    # one split (its gradient a concatenation), not n slices (n zero-padded gradients added up)
    return [lax.squeeze(part, (d,)) for part in lax.split(x, (1,) * x.shape[d], axis=d)] if x.shape[d] else []


@register(aten.slice.Tensor)
def slice_(x, dim=0, start=None, end=None, step=1):
    d = dim % x.ndim
    lo, hi, st = slice(start, end, step).indices(x.shape[d])
    if hi <= lo:
        return lax.slice_in_dim(x, lo, lo, 1, d)
    return lax.slice_in_dim(x, lo, hi, st, d)


@register(aten.select.int)
def select(x, dim_, index):
    d = dim(dim_, x.ndim)
    return lax.index_in_dim(x, index % x.shape[d], d, keepdims=False)


@register(aten.narrow.default)
def narrow(x, dim_, start, length):
    d = dim(dim_, x.ndim)
    start %= x.shape[d]
    return lax.slice_in_dim(x, start, start + length, 1, d)


@register(aten.flip.default)
def flip(x, dims):
    return jnp.flip(x, tuple(dims))


@register(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(dims))


@register(aten.repeat.default)
def repeat(x, repeats):
    return jnp.tile(x, tuple(repeats))


@register(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    # pad lists (before, after) pairs from the last dim backwards; negative amounts crop
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), config)


@register(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@register(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@register(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    d = dim % x.ndim
    lo, hi, st = slice(start, end, step).indices(x.shape[d])
    index = [slice(None)] * x.ndim
    index[d] = slice(lo, hi, st)
    return x.at[tuple(index)].set(src.astype(x.dtype))


@register(aten.select_scatter.default)
def select_scatter(x, src, dim_, index):
    d = dim(dim_, x.ndim)
    where = [slice(None)] * x.ndim
    where[d] = index % x.shape[d]
    return x.at[tuple(where)].set(src.astype(x.dtype))


@register(aten.as_strided.default, aten.as_strided_copy.default, input_meta=True)
def as_strided(x, size, stride, storage_offset=None, *, meta):
    """`x.as_strided(size, stride, storage_offset)`, read through the layout torch recorded for x
    (`meta`: its strides and storage offset)."""
    x_meta, offset = meta, storage_offset
    size, stride = tuple(size), tuple(stride)
    offset = x_meta.storage_offset() if offset is None else offset
    # storage position of every element of x, and which flat element of x sits at each position
    positions = x_meta.storage_offset() + sum(
        (np.arange(n).reshape((-1,) + (1,) * (x.ndim - 1 - i)) * s for i, (n, s) in enumerate(zip(x.shape, x_meta.stride()))),
        np.zeros((), np.int64))
    positions = np.broadcast_to(positions, x.shape).reshape(-1)
    element = np.full(int(positions.max(initial=0)) + 1 if positions.size else 0, -1, np.int64)
    element[positions] = np.arange(positions.size)
    wanted = offset + sum((np.arange(n).reshape((-1,) + (1,) * (len(size) - 1 - i)) * s
                           for i, (n, s) in enumerate(zip(size, stride))), np.zeros((), np.int64))
    wanted = np.broadcast_to(wanted, size).reshape(-1)
    if wanted.size and (wanted.max() >= element.size or (element[wanted] < 0).any()):
        raise UnsupportedOpError(
            f"torch -> XLA: aten.as_strided reads storage outside its input (input {tuple(x.shape)} with strides "
            f"{tuple(x_meta.stride())}, view {size} strides {stride} offset {offset}); write the view with "
            "reshape / slicing instead")
    flat = element[wanted] if wanted.size else np.zeros(0, np.int64)
    if np.array_equal(flat, np.arange(flat.size)) and flat.size == int(np.prod(x.shape)):
        return jnp.reshape(x, size)
    return jnp.take(jnp.reshape(x, (-1,)), jnp.asarray(flat, jnp.int32)).reshape(size)


@register(aten.unfold.default)
def unfold(x, dimension, size, step):
    """Windows of `size` every `step` along `dimension`, as a new last dim (Tensor.unfold)."""
    if x.ndim == 0:
        return jnp.reshape(x, (1,))
    d = dim(dimension, x.ndim)
    count = (x.shape[d] - size) // step + 1
    index = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(x, jnp.asarray(index, jnp.int32), axis=d), d + 1, -1)


# the out-of-place copies of views (torch.narrow_copy, permute_copy, ...): torch's decompositions
# into the view and a clone are exact
decompose_with_torch(aten.narrow_copy.default, aten.permute_copy.default, aten.view_copy.default,
                     aten.unbind_copy.int)
