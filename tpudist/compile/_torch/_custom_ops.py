"""`tpudist::stop_gradient`, the marker that keeps `detach()` and `torch.no_grad()` through capture.

Decomposing an exported program to core ATen turns `x.detach()` into a plain `aten.alias` and
inlines `torch.no_grad()` blocks, which is harmless for torch (the graph is not differentiated by
torch) but wrong for us: the backward pass is JAX's autodiff of the lowered graph, so both must
become `lax.stop_gradient`. Capture rewrites them to this custom op, which decomposition leaves alone.
"""

from __future__ import annotations

import ast

import torch


@torch.library.custom_op("tpudist::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """Returns a copy of `x` that gradients do not flow through (the graph-level `detach`)."""
    return x.clone()


@stop_gradient.register_fake
def _stop_gradient_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


STOP_GRADIENT = torch.ops.tpudist.stop_gradient.default

# A parameter carrying this attribute (set to True) holds one process's shard of a larger tensor
# (`tpudist.nn.ShardedEmbedding`'s rows, looked up through the op below); its .grad is already
# summed over processes by the module's backward, so `tpudist.optimizer_step` does not all-reduce
# it (see optimizer_step for how it is scaled), and the fused step splits it over the devices.
SHARDED_ATTR = "_tpudist_sharded"


@torch.library.custom_op("tpudist::sharded_embedding_lookup", mutates_args=())
def sharded_embedding_lookup(block: torch.Tensor, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """`tpudist.nn.ShardedEmbedding`'s lookup as one graph node: this process's row `block` and
    its (bags, bag) `ids` -> (bags, dim) vectors, the bag summed ("sum"), averaged ("mean") or of one
    id ("none"). Only captured, never run by torch: the fused train step lowers it to in-graph
    collectives (all_gather of the ids, masked local lookup, psum_scatter)."""
    raise RuntimeError("tpudist::sharded_embedding_lookup runs only inside tpudist's fused train step; "
                       "ShardedEmbedding's eager forward does not call it")


@sharded_embedding_lookup.register_fake
def _sharded_embedding_lookup_fake(block: torch.Tensor, ids: torch.Tensor, mode: str) -> torch.Tensor:
    return block.new_empty((ids.shape[0], block.shape[1]))


SHARDED_EMBEDDING_LOOKUP = torch.ops.tpudist.sharded_embedding_lookup.default

# ops that reach other processes: a graph holding one runs as one program over the processes
COLLECTIVE_OPS = frozenset({SHARDED_EMBEDDING_LOOKUP})


@torch.library.custom_op("tpudist::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """`F.scaled_dot_product_attention` as one graph node that decomposition leaves whole (lowered
    to one XLA attention op). Only captured, never run by torch."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa).clone()


@attention.register_fake
def _attention_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # torch's own kernel choice gives the output's strides, which the traced graph's later views
    # (transpose, then view) were recorded against
    out = torch.ops.aten.scaled_dot_product_attention.default(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)


ATTENTION = torch.ops.tpudist.attention.default


@torch.library.custom_op("tpudist::experts", mutates_args=())
def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, act: str) -> torch.Tensor:
    """A mixture-of-experts layer's experts as one graph node (`lowering/_experts.py`): each token
    (row of `hidden`, (T, H)) through its `top_k_index` experts (T, k), weighted by `top_k_weights`
    and summed; expert e computes `down[e] @ (act(gate) * up)` with `gate, up = gate_up[e] @ x`
    split in halves. Only captured, never run by torch; this body states the arithmetic."""
    out = torch.zeros_like(hidden, dtype=torch.promote_types(hidden.dtype, top_k_weights.dtype))
    fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "relu": torch.relu,
          "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[act]
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(top_k_index == e)
        gate, up = torch.nn.functional.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, token, torch.nn.functional.linear(fn(gate) * up, down[e]) * top_k_weights[token, slot, None])
    return out.to(hidden.dtype)


@experts.register_fake
def _experts_fake(hidden, top_k_index, top_k_weights, gate_up, down, act):
    return torch.empty_like(hidden)


EXPERTS = torch.ops.tpudist.experts.default


@torch.library.custom_op("tpudist::layer", mutates_args=())
def layer(run: str, index: int, spec: str, reads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layer `index` of a run of identical layers, standing in for its nodes while the graph is
    decomposed (`lowering/_collapse.py`): `reads` are its outside reads, the outputs the values read
    after it, described by `spec`. Never run: expanded into a copy of the run's first layer."""
    raise RuntimeError("tpudist::layer is expanded before anything runs the graph")


@layer.register_fake
def _layer_fake(run, index, spec, reads):
    return [torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
            for shape, stride, dtype, device in ast.literal_eval(spec)]


LAYER = torch.ops.tpudist.layer.default


@torch.library.custom_op("tpudist::layer_mark", mutates_args=())
def layer_mark(x: torch.Tensor, run: str, role: str, slot: int) -> torch.Tensor:
    """Marks a read ("in") or an output ("out") of a run's first layer while the graph is
    decomposed (`lowering/_collapse.py`); dropped after it."""
    return x.clone()


@layer_mark.register_fake
def _layer_mark_fake(x, run, role, slot):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


LAYER_MARK = torch.ops.tpudist.layer_mark.default
