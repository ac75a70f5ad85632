"""Indexing: advanced indexing, gather / scatter, index_select, Embedding and EmbeddingBag."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch._registry import register
from tpudist.compile._torch.ops._util import dim as norm_dim, unsupported_arg

aten = __import__("torch").ops.aten


def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


@register(aten.index.Tensor)
def index(x, indices):
    # torch follows NumPy's advanced-indexing rules, as JAX does, including where the
    # broadcast index dims land when index tensors are separated by a slice
    return x[_index_tuple(indices)]


@register(aten.index_put.default)
def index_put(x, indices, values, accumulate=False):
    at = x.at[_index_tuple(indices)]
    return at.add(values) if accumulate else at.set(values)


@register(aten.index_select.default)
def index_select(x, dim, index):
    return jnp.take(x, index, axis=dim)


def _scatter_index(index, dim):
    """The full index tuple that addresses, along `dim`, the positions `index` names."""
    grids = jnp.meshgrid(*[jnp.arange(s) for s in index.shape], indexing="ij")
    return tuple(index if d == dim else grids[d] for d in range(index.ndim))


def _fit(src, index):
    # torch reads src only where index has entries; src may be larger in every dim
    return src[tuple(slice(0, s) for s in index.shape)]


@register(aten.gather.default)
def gather(x, dim, index, *, sparse_grad=False):
    if index.ndim == 0:
        return x[()] if x.ndim == 0 else jnp.take(x, index, axis=0)
    d = norm_dim(dim, x.ndim)
    return x[_scatter_index(index, d)]


@register(aten.scatter.src, aten.scatter.value)
def scatter(x, dim, index, src):
    d = norm_dim(dim, x.ndim)
    src = _fit(src, index) if hasattr(src, "shape") and jnp.ndim(src) else src
    return x.at[_scatter_index(index, d)].set(src)


@register(aten.scatter_add.default)
def scatter_add(x, dim, index, src):
    return x.at[_scatter_index(index, norm_dim(dim, x.ndim))].add(_fit(src, index))


@register(aten.scatter_reduce.two)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    where = _scatter_index(index, norm_dim(dim, x.ndim))
    src = _fit(src, index)
    if reduce in ("sum", "mean"):
        base = x if include_self else x.at[where].set(0)
        total = base.at[where].add(src)
        if reduce == "sum":
            return total
        counts = jnp.zeros(x.shape, jnp.int32).at[where].add(1) + (1 if include_self else 0)
        divided = total / jnp.maximum(counts, 1).astype(total.dtype)
        return divided if jnp.issubdtype(x.dtype, jnp.floating) else jnp.floor_divide(total, jnp.maximum(counts, 1))
    identity = {"prod": 1, "amax": -jnp.inf, "amin": jnp.inf}.get(reduce)
    if identity is None:
        raise unsupported_arg("aten.scatter_reduce.two", f"reduce={reduce!r}")
    base = x if include_self else x.at[where].set(jnp.asarray(identity).astype(x.dtype))
    at = base.at[where]
    return {"prod": at.multiply, "amax": at.max, "amin": at.min}[reduce](src)


@register(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq:
        raise unsupported_arg("aten.embedding", "scale_grad_by_freq=True")
    rows = jnp.take(weight, indices, axis=0)
    if padding_idx is not None and padding_idx >= 0:
        # the padding row is read as usual but, as in torch, never receives a gradient
        rows = jnp.where((indices == padding_idx)[..., None], lax.stop_gradient(rows), rows)
    return rows


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Returns (output, offset2bag, bag_size, max_indices); only `output` is read by nn.EmbeddingBag."""
    if scale_grad_by_freq:
        raise unsupported_arg("aten._embedding_bag", "scale_grad_by_freq=True")
    n = indices.shape[0]
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    # bag of each index: the last offset at or before its position
    offset2bag = jnp.clip(jnp.searchsorted(offsets[:bags], jnp.arange(n), side="right") - 1, 0, max(bags - 1, 0))
    if include_last_offset and bags:
        # positions at or past the closing offset belong to no bag
        offset2bag = jnp.where(jnp.arange(n) < offsets[bags], offset2bag, bags)
    valid = indices != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones(n, bool)
    rows = jnp.take(weight, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    bag_size = jax.ops.segment_sum(valid.astype(jnp.int32), offset2bag, bags + 1)[:bags]
    if mode == 2:  # max
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        out = jax.ops.segment_max(masked, offset2bag, bags + 1)[:bags]
        out = jnp.where((bag_size > 0)[:, None], out, 0)
        hit = (rows == out[jnp.minimum(offset2bag, bags - 1)]) & valid[:, None]
        big = jnp.iinfo(jnp.int32).max
        max_indices = jax.ops.segment_min(jnp.where(hit, indices[:, None], big), offset2bag, bags + 1)[:bags]
        return out, offset2bag, bag_size, jnp.where(max_indices == big, 0, max_indices)
    summed = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), offset2bag, bags + 1)[:bags]
    if mode == 1:  # mean; an empty bag is zeros, as in torch
        summed = summed / jnp.maximum(bag_size, 1)[:, None].astype(summed.dtype)
    return summed, offset2bag, bag_size, jnp.zeros((bags,), jnp.int32)
