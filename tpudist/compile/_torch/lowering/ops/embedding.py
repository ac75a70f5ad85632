"""Embeddings: `aten.embedding` (a row gather whose padding row gets no gradient) and
`aten._embedding_bag` (sums, means or maxima of bags of rows, as nn.EmbeddingBag computes them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped

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
