"""Attention: `F.scaled_dot_product_attention`, kept whole by capture (`tpudist::attention`).

One lowering instead of torch's decomposition: on an accelerator without dropout it is
`jax.nn.dot_product_attention` (XLA's attention, which a GPU backend may run as a fused kernel);
on CPU, and with dropout anywhere, the same math written out (scores, softmax in float32, the
weights dropped out as torch does): on XLA:CPU that form measured 1.2x faster in a transformer
block's train step than `dot_product_attention`'s (whose layout transposes do not fuse there). Causal masks are aligned top-left, boolean masks
keep the positions that are True, float masks are added to the scores; `enable_gqa` shares each
key/value head among query heads (Llama's grouped-query attention).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tpudist.compile._torch._custom_ops import ATTENTION
from tpudist.compile._torch.lowering._parallel import CONTEXT_AXIS, current
from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering.ops._util import in_float32, unsupported_arg
from tpudist.compile._torch.lowering.ops.linalg import accumulation
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _has_dropout(node) -> bool:
    return float(node.args[4]) > 0.0


@register(ATTENTION, random=_has_dropout)
def attention(*args):
    if len(args) == 9:  # a random node: the key comes first
        key, q, k, v, mask, dropout_p, causal, scale, gqa = args
    else:
        key, (q, k, v, mask, dropout_p, causal, scale, gqa) = None, args
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[-3:-2] != k.shape[-3:-2] and q.ndim >= 3:  # grouped-query: one k/v head per group
        group = q.shape[-3] // k.shape[-3]
        if not gqa and group != 1:
            raise ValueError(f"query has {q.shape[-3]} heads and key {k.shape[-3]}; pass enable_gqa=True")
    layout = current()
    if layout is not None and layout.size(CONTEXT_AXIS) > 1 and q.ndim == 4 and q.shape[-2] == k.shape[-2]:
        return _context_parallel(layout.mesh, layout.size(CONTEXT_AXIS), key, q, k, v, mask, dropout_p, causal,
                                 scale)
    if key is None and q.ndim == 4 and q.shape[-1] == v.shape[-1] and jax.default_backend() != "cpu":
        bias = mask if mask is not None and mask.dtype != jnp.bool_ else None
        keep = mask if mask is not None and mask.dtype == jnp.bool_ else None
        out = jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2),
            bias=None if bias is None else jnp.broadcast_to(bias, _scores_shape(q, k)).astype(q.dtype),
            mask=None if keep is None else jnp.broadcast_to(keep, _scores_shape(q, k)),
            scale=scale, is_causal=causal)
        out = out.swapaxes(1, 2)
        if mask is not None:  # XLA's masks a row of nothing with a finite minimum: uniform weights, not 0
            out = jnp.where(_attends_nowhere(mask), 0, out).astype(out.dtype)
        return out
    return _math(key, q, k, v, mask, dropout_p, causal, scale)


def _context_parallel(mesh, devices, key, q, k, v, mask, dropout_p, causal, scale):
    """Self-attention with its sequence split over the mesh's "context" axis: each device keeps its
    block of queries (its block of the sequence), all-gathers the keys and values, and attends with
    the rows of the causal mask and of `mask` that belong to its queries. Every device computes
    rows x length scores, so a causal attention's work is even across them without reordering the
    sequence (at twice the causal minimum)."""
    length = q.shape[-2]
    if length % devices:
        raise ValueError(f"context parallelism: a sequence of {length} positions does not split over the {devices} "
                         f"devices of mesh axis {CONTEXT_AXIS!r}; pad the sequence to a multiple of {devices}")
    rows = length // devices
    split = P(None, None, CONTEXT_AXIS, None)
    mask_split = P() if mask is None or mask.shape[-2] == 1 else P(*([None] * (mask.ndim - 2)), CONTEXT_AXIS, None)

    def local(q, k, v, mask, key):
        k, v = (lax.all_gather(x, CONTEXT_AXIS, axis=2, tiled=True) for x in (k, v))
        first = lax.axis_index(CONTEXT_AXIS) * rows
        if causal:
            keep = (first + jnp.arange(rows))[:, None] >= jnp.arange(length)[None, :]
            if mask is None:
                mask = keep
            else:
                mask = mask & keep if mask.dtype == jnp.bool_ else jnp.where(keep, mask, -jnp.inf)
        if key is not None:
            key = jax.random.fold_in(key, lax.axis_index(CONTEXT_AXIS))  # each block its own dropout draws
        return _math(key, q, k, v, mask, dropout_p, False, scale)

    inputs = [q, k, v, mask, key]
    specs = [split, split, split, mask_split, P()]
    present = [i for i, x in enumerate(inputs) if x is not None]

    def body(*given):
        full = [None] * len(inputs)
        for i, x in zip(present, given):
            full[i] = x
        return local(*full)
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[i] for i in present), out_specs=split,
                         axis_names={CONTEXT_AXIS}, check_vma=False)(*(inputs[i] for i in present))


def _attends_nowhere(mask):
    """Per query: whether its mask keeps no key (all False, or all -inf); torch's attention gives
    such a query 0 (a left-padded batch's padding rows), and 0 gradient."""
    dropped = ~mask if mask.dtype == jnp.bool_ else mask == -jnp.inf
    return jnp.all(dropped, axis=-1, keepdims=True)


def _scores_shape(q, k):
    return (*q.shape[:-1], k.shape[-2])


def _math(key, q, k, v, mask, dropout_p, causal, scale):
    heads = q.shape[-3] if q.ndim >= 3 else 1
    group = heads // k.shape[-3] if q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] != heads else 1
    if group > 1:
        # grouped-query attention on the key/value heads as they are: each query head's group is
        # an axis of its own, so no copy of the keys and values per query head is made
        q = q.reshape(*q.shape[:-3], k.shape[-3], group, *q.shape[-2:])
        k, v = k[..., None, :, :], v[..., None, :, :]
        if mask is not None and mask.ndim >= 3:
            mask = (mask.reshape(*mask.shape[:-3], k.shape[-4], group, *mask.shape[-2:]) if mask.shape[-3] == heads
                    else mask[..., None, :, :])
    weights = masked_softmax(_scores(q, k, mask, causal, scale).astype(jnp.float32), -1).astype(q.dtype)
    if key is not None and dropout_p > 0:
        kept = jax.random.bernoulli(key, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(kept, weights / (1.0 - dropout_p), 0).astype(weights.dtype)
    out = jnp.einsum("...ls,...sv->...lv", weights, v, **accumulation(weights, v))
    return out.reshape(*out.shape[:-4], heads, *out.shape[-2:]) if group > 1 else out


def _shared(q, k, v):
    """k and v with each head repeated for the query heads that share it (grouped-query attention)."""
    if k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    return k, v


def _scores(q, k, mask, causal, scale):
    scores = jnp.einsum("...le,...se->...ls", q, k, **accumulation(q, k)) * scale
    length, source = q.shape[-2], k.shape[-2]
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, source), bool)), scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf) if mask.dtype == jnp.bool_ else scores + mask.astype(scores.dtype)
    return scores


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_for_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """torch's CPU attention kernel called by name: (output, the log-sum-exp of each query's scores).
    Kept whole: torch's decomposition returns the attention weights in the log-sum-exp's place."""
    if dropout_p > 0:
        raise unsupported_arg("aten._scaled_dot_product_flash_attention_for_cpu", f"dropout_p={dropout_p} "
                              "(torch's decomposition refuses it too); call F.scaled_dot_product_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = _math(None, q, k, v, attn_mask, 0.0, is_causal, scale)
    k, _ = _shared(q, k, v)
    scores = _scores(q, k, attn_mask, is_causal, scale).astype(jnp.promote_types(q.dtype, jnp.float32))
    # torch's kernel returns it for its own backward only: not differentiable
    return out, jax.lax.stop_gradient(jax.nn.logsumexp(scores, axis=-1))


keep_whole(aten._scaled_dot_product_flash_attention_for_cpu.default)


@register(aten._safe_softmax.default)
@in_float32
def safe_softmax(x, dim, dtype=None):
    """Softmax whose rows of only -inf (a query that may attend nowhere) are 0 rather than NaN, and
    whose gradient there is 0 too, as torch's kernel (its derivative is softmax's, of that 0 output;
    torch's decomposition, a `where` after a NaN softmax, would give NaN)."""
    return masked_softmax(x, dim)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def masked_softmax(x, axis):
    """Softmax along `axis` whose rows of only -inf (a query that attends nowhere) are 0, with 0
    gradient, as torch's kernels give (not NaN). Such a row's maximum is taken as 0, so its
    exponentials are all 0 and its sum is divided by 1: no pass over the scores beyond softmax's
    own (a check of every score for -inf was one more pass, and on a decode step one more fused
    loop per layer). Differentiated as `jax.nn.softmax` is."""
    top = jnp.max(x, axis=axis, keepdims=True)
    exp = jnp.exp(x - jnp.where(top == -jnp.inf, 0, top))
    total = jnp.sum(exp, axis=axis, keepdims=True)
    return exp / jnp.where(total == 0, 1, total)


@masked_softmax.defjvp
def _masked_softmax_jvp(axis, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = masked_softmax(x, axis)
    return y, y * (x_dot - jnp.sum(y * x_dot, axis=axis, keepdims=True))


keep_whole(aten._safe_softmax.default)  # torch.export's table has the NaN-gradient decomposition
