"""A mixture-of-experts layer's experts as one op (`tpudist::experts`), and expert parallelism.

Capture turns a `transformers` experts module (stacked `gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I), see `lowering/_experts.py`) into this one op when the mesh (a sharded fused step's, or
a model's laid out by `tpudist.parallelize`) has an "expert" axis.
Its lowering sends each (token, expert) pair to the device that holds the expert and back, inside
the executable:

- the tokens are split over the batch axes and the expert axis; the experts over the expert axis;
- each device orders its pairs by destination device, then by expert, into one block per
  destination; an all-to-all over the expert axis delivers them; the receiving device runs its
  experts as two ragged matmuls (XLA's ragged dot, one group per local expert) and an all-to-all
  sends the results back, where each token's results are weighted and summed.

No token is dropped: each block has room for every pair of the sending device (all of them may
choose one device's experts), so the exchange moves N times the pairs' bytes over N devices: the
price of exact results without a capacity factor. Without an expert axis the same op runs on one
device's experts (the blocks and exchanges fall away).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tpudist.compile._torch._custom_ops import EXPERTS
from tpudist.compile._torch.lowering._parallel import EXPERT_AXIS, current
from tpudist.compile._torch.lowering._table import register

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


@register(EXPERTS)
def experts(hidden, top_k_index, top_k_weights, gate_up, down, act):
    layout = current()
    if layout is None or layout.size(EXPERT_AXIS) == 1:
        return _local(hidden, top_k_index, top_k_weights, gate_up, down, act, axis=None, devices=1)
    mesh, axis = layout.mesh, EXPERT_AXIS
    devices = layout.size(axis)
    count = gate_up.shape[0]
    if count % devices:
        raise ValueError(f"expert parallelism: {count} experts do not split over the {devices} devices of mesh axis "
                         f"{axis!r}; use a mesh whose {axis!r} axis divides the number of experts")
    token_axes = tuple(a for a in layout.batch_axes if a != axis) + (axis,)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if hidden.shape[0] % shards:
        raise ValueError(f"expert parallelism: {hidden.shape[0]} tokens (batch x sequence) do not split over the "
                         f"{shards} devices of mesh axes {token_axes}; use a batch whose tokens divide")
    tokens = P(token_axes)
    body = jax.shard_map(
        lambda h, i, w, gu, dn: _local(h, i, w, gu, dn, act, axis=axis, devices=devices),
        mesh=mesh, in_specs=(tokens, tokens, tokens, P(axis), P(axis)), out_specs=tokens,
        axis_names=set(token_axes), check_vma=False)
    return body(hidden, top_k_index, top_k_weights, gate_up, down)


def _local(hidden, top_k_index, top_k_weights, gate_up, down, act, *, axis, devices):
    """One device's part: its tokens' pairs sent to their experts' devices, run there, returned
    and combined. `gate_up` (E/N, 2I, H) and `down` (E/N, H, I) are this device's experts."""
    tokens, width = hidden.shape
    k = top_k_index.shape[1]
    pairs = tokens * k
    local = gate_up.shape[0]  # experts per device
    expert = top_k_index.reshape(pairs).astype(jnp.int32)
    dest, mine = expert // local, expert % local
    order = jnp.argsort(dest * local + mine, stable=True)  # by destination, then by its expert
    source = order // k  # the token each ordered pair comes from
    dest_sorted = dest[order]
    counts = jnp.zeros(devices, jnp.int32).at[dest].add(1)
    slot = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest_sorted]
    # room for every pair in each destination's block: nothing is dropped
    send = jnp.zeros((devices, pairs, width), hidden.dtype).at[dest_sorted, slot].set(hidden[source])
    send_expert = jnp.full((devices, pairs), local, jnp.int32).at[dest_sorted, slot].set(mine[order])
    if axis is not None:
        send = lax.all_to_all(send, axis, 0, 0)
        send_expert = lax.all_to_all(send_expert, axis, 0, 0)
    rows, row_expert = send.reshape(devices * pairs, width), send_expert.reshape(devices * pairs)
    by_expert = jnp.argsort(row_expert, stable=True)  # empty slots (expert `local`) go last
    sizes = jnp.zeros(local + 1, jnp.int32).at[row_expert].add(1)[:local]
    x = rows[by_expert]
    both = lax.ragged_dot(x, gate_up.transpose(0, 2, 1), sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    gate, up = jnp.split(both, 2, axis=-1)
    y = lax.ragged_dot(ACTIVATIONS[act](gate) * up, down.transpose(0, 2, 1), sizes,
                       preferred_element_type=jnp.float32).astype(x.dtype)
    back = jnp.zeros_like(rows).at[by_expert].set(y).reshape(devices, pairs, width)
    if axis is not None:
        back = lax.all_to_all(back, axis, 0, 0)
    weights = top_k_weights.reshape(pairs)[order]
    weighted = back[dest_sorted, slot] * weights[:, None]
    out = jnp.zeros((tokens, width), weighted.dtype).at[source].add(weighted)
    return out.astype(hidden.dtype)
