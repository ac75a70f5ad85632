"""Pipeline parallelism: a run of identical layers split into contiguous stages over a "stage" mesh axis.

A sharded fused step on a mesh with a "stage" axis of S devices holds the layers of the model's
longest run of identical layers (`_layers.Scan`: `model.layers.0` ... `model.layers.{L-1}`)
stacked, L/S consecutive layers per stage (`train/_stages.py`). The step's batch arrives as M
micro-batches (`accumulate_steps=M`, each captured at the micro-batch's size); `run` computes

- what comes before the layers (embeddings, masks, rotary tables) for every micro-batch (`vmap`);
- the layers as a GPipe schedule (`_stages`): M + S - 1 ticks; at tick t stage s runs its layers
  on micro-batch t - s, and hands its result to stage s + 1 (`ppermute`). Stage 0 takes micro-batch
  t from the input; the last stage keeps micro-batch t - S + 1's result. Reverse-mode autodiff
  of the ticks is the backward pipeline (ticks in reverse, results handed back to stage s - 1);
- what comes after the layers (final norm, head, loss) for every micro-batch (`vmap`).

Every stage computes at every tick: the S - 1 ticks a stage has no micro-batch (the bubble,
(S - 1) / (M + S - 1) of the ticks) run on a placeholder, masked out of every result and gradient.
The parts before and after the layers run on every stage (as MaxText's pipeline does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.sharding import PartitionSpec as P

from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch.lowering._layers import Scan
from tpudist.compile._torch.lowering._parallel import STAGE_AXIS, MeshLayout


@dataclass(frozen=True)
class Rows:
    """A graph input that is row `index` of a stacked array (a pipelined layer's parameter, stored
    with its run's other layers: `train/_stages.py`); the layers' scan takes `stack` itself."""

    stack: Any
    index: int


def pipelined_scan(scans: list[Scan]) -> Scan | None:
    """The run of layers a "stage" axis splits: the one with the most layers (the first of equals)."""
    return max(scans, key=lambda scan: len(scan.layers), default=None)


def check_scan(scan: Scan | None, stages: int) -> Scan:
    """`scan` when S stages can split it; ValueError naming what is missing otherwise."""
    if scan is None:
        raise ValueError(f"pipeline parallelism (mesh axis {STAGE_AXIS!r}) splits a run of identical layers into "
                         "stages: the modules of a module list, each called as a module (`for layer in self.layers: "
                         "x = layer(x)`, as transformers' models do); the capture found none in this model "
                         "(TPUDIST_SCAN_LAYERS=0 turns the search off): call the layers as modules, or train "
                         "without a 'stage' axis")
    count = len(scan.layers)
    if count % stages:
        raise ValueError(f"pipeline parallelism: the {count} layers of {scan.container.removeprefix('traced.')} do not "
                         f"split into the {stages} stages of mesh axis {STAGE_AXIS!r}; use a stage count that divides "
                         f"{count}")
    outside = {node for layer in scan.layers[:-1] for node in layer for user in node.users
               if user not in scan.members()}
    if outside:
        raise ValueError(f"pipeline parallelism: the model reads values of layers other than the last after its layers "
                         f"({sorted(n.name for n in outside)[:3]}, e.g. output_hidden_states=True); the stages hand on "
                         "only the last layer's results: turn that output off")
    return scan


def run_pipelined(steps: list[Any], scan: Scan, env: dict, batch_nodes: list[torch.fx.Node], key: Any,
                  microbatches: int, layout: MeshLayout, evaluate: Callable[[Any, dict, Any], None],
                  layer: Callable[..., Callable], output: Any, read: Callable[[Any, dict], Any]) -> Any:
    """The graph's outputs per micro-batch (each with a leading dim of `microbatches`): `env` holds
    the graph's inputs (the batch's with a leading micro-batch dim, a stacked parameter's rows as
    `Rows`); `evaluate(step, env, key)` computes one step; `layer(shared, key)` is one layer of
    `scan` as a scan body (`_lower._layer`)."""
    at = steps.index(scan)
    before, after = steps[:at], steps[at + 1:]
    made = {node for step in before for node in _made(step)}
    batch = [env.pop(node) for node in batch_nodes]
    stacks = {node: env[node] for node in env if isinstance(env[node], Rows)}
    for node, rows in stacks.items():
        env[node] = rows.stack[rows.index]
    last = scan.layers[-1]
    wanted = [n for n in dict.fromkeys([*scan.shared, *scan.carried, *(v for vs in scan.stacked.values() for v in vs),
                                        *(n for step in after for n in _reads(step))]) if n in made]
    keys = None if key is None else jax.vmap(lambda m: jax.random.fold_in(key, m))(jnp.arange(microbatches))

    def part(steps: list[Any], fed: list[torch.fx.Node], values: list[Any], k: Any) -> dict:
        local = dict(env)
        local.update(zip(batch_nodes, values[0]))
        local.update(zip(fed, values[1]))
        for step in steps:
            evaluate(step, local, k)
        return local

    pre = jax.vmap(lambda b, k: [part(before, [], [b, []], k)[n] for n in wanted])(batch, keys)
    fed = dict(zip(wanted, pre))
    fed.update(zip(batch_nodes, batch))
    per_micro = set(fed)
    weights = []
    for first, values in scan.stacked.items():
        if any(v in per_micro for v in values):
            raise ValueError(f"pipeline parallelism: each layer of {scan.container.removeprefix('traced.')} reads its "
                             f"own {first.name}, computed before the layers; the stages take only parameters and "
                             "buffers per layer: compute it inside the layer")
        origin = [stacks.get(v) for v in values]
        if all(o is not None and o.stack is origin[0].stack and o.index == i for i, o in enumerate(origin)):
            weights.append(origin[0].stack)
        else:
            weights.append(jnp.stack([env[v] for v in values]))
    varying = [n for n in scan.shared if n in per_micro]
    fixed = [n for n in scan.shared if n not in per_micro and isinstance(env[n], jax.Array)]
    constants = {n: env[n] for n in scan.shared if n not in per_micro and n not in fixed}
    starts = [fed[n] if n in per_micro else jnp.broadcast_to(env[n], (microbatches, *jnp.shape(env[n])))
              for n in scan.carried]
    results = _stages(scan, lambda shared, k: layer({**constants, **shared}, k), starts, [fed[n] for n in varying],
                      [env[n] for n in fixed], varying, fixed, weights, keys, microbatches, layout)
    outs = [last[k] for k in scan.outputs]
    return jax.vmap(lambda w, b, r, k: read(output, part(after, [*wanted, *outs], [b, [*w, *r]], k)))(
        pre, batch, results, keys)


def _stages(scan: Scan, layer: Callable[..., Callable], starts: list, varying_values: list, fixed_values: list,
            varying: list, fixed: list, weights: list, keys: Any, microbatches: int, layout: MeshLayout) -> list[Any]:
    """The layers over the stages, GPipe (see the module docstring): per output of the last layer
    (`scan.outputs`), its value for every micro-batch."""
    stages = layout.size(STAGE_AXIS)
    per = len(scan.layers) // stages
    key_data = None if keys is None else jax.random.key_data(keys)
    ring = [(i, (i + 1) % stages) for i in range(stages)]

    def local(starts, varying_values, fixed_values, weights, key_data):
        s = lax.axis_index(STAGE_AXIS)
        first_layer = s * per

        def ticked(state, t):
            carry, kept = state
            m_in = jnp.clip(t, 0, microbatches - 1)
            x = tuple(jnp.where(s == 0, start[m_in], c) for start, c in zip(starts, carry))
            m = jnp.clip(t - s, 0, microbatches - 1)  # the micro-batch this stage runs now
            shared = dict(zip(fixed, fixed_values))
            shared.update(zip(varying, [v[m] for v in varying_values]))
            k = None if key_data is None else jax.random.wrap_key_data(key_data[m])
            y, rows = lax.scan(layer(shared, k), x, (first_layer + jnp.arange(per), weights))
            done = (s == stages - 1) & (t >= stages - 1)
            slot = jnp.clip(t - (stages - 1), 0, microbatches - 1)
            kept = [o.at[slot].set(jnp.where(done, r[-1], o[slot])) for o, r in zip(kept, rows)]
            return ([lax.ppermute(v, STAGE_AXIS, ring) for v in y], kept), None

        carry = [jnp.zeros_like(start[0]) for start in starts]
        kept = [jnp.zeros((microbatches, *v.shape), v.dtype) for v in _last_values(scan)]
        (_, kept), _ = lax.scan(ticked, (carry, kept), jnp.arange(microbatches + stages - 1))
        return [o[None] for o in kept]

    staged = jax.shard_map(local, mesh=layout.mesh, in_specs=(P(), P(), P(), P(STAGE_AXIS), P()),
                           out_specs=P(STAGE_AXIS), axis_names={STAGE_AXIS}, check_vma=False)
    return [o[stages - 1] for o in staged(starts, varying_values, fixed_values, weights, key_data)]


def _last_values(scan: Scan) -> list[jax.ShapeDtypeStruct]:
    """The shapes of one micro-batch's values of the last layer's outputs (`scan.outputs`)."""
    out = []
    for k in scan.outputs:
        value = scan.layers[-1][k].meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"pipeline parallelism: the layers' output {scan.layers[-1][k].name} is not a tensor")
        out.append(jax.ShapeDtypeStruct(tuple(value.shape), jax_dtype(value.dtype)))
    return out


def _made(step: Any) -> list[torch.fx.Node]:
    """The nodes one lowering step (a node, a checkpointed region, a scan) puts in the environment."""
    if isinstance(step, torch.fx.Node):
        return [step]
    if isinstance(step, Scan):
        return [node for layer in step.layers for node in layer]
    return list(step.outputs)


def _reads(step: Any) -> list[torch.fx.Node]:
    """The nodes one lowering step reads from the environment."""
    if isinstance(step, torch.fx.Node):
        return list(step.all_input_nodes)
    if isinstance(step, Scan):
        return [*step.shared, *step.carried, *(v for vs in step.stacked.values() for v in vs)]
    return list(step.inputs)
