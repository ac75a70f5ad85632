"""Pipeline parallelism's state: each pipelined layer's parameters stored stacked over the "stage" axis.

On a mesh with a "stage" axis, the layers of the model's longest run of identical layers
(`lowering/_pipeline.py`) are split into consecutive stages: stage s holds layers s*L/S to
(s+1)*L/S - 1. A per-layer array cannot live on one stage's devices alone in one program, so the
step holds each such parameter (`layers.{i}.mlp.up_proj.weight`, i = 0..L-1) as one stacked array
(L, ...) split over "stage" on its first dim (and over other axes as FSDP / TP split one layer's),
with its optimizer state the same way. `Stacking` turns the per-parameter arrays (what doors,
checkpoints and uploads read and write) into the stacked ones (what the step takes) and back, one
small executable per stack each way, only when the other form changed (`train/_pool.py` holds
whichever is current).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist.compile._torch.lowering._layers import find_scans, min_layers
from tpudist.compile._torch.lowering._parallel import STAGE_AXIS
from tpudist.compile._torch.lowering._pipeline import check_scan, pipelined_scan

if TYPE_CHECKING:
    from tpudist.compile._torch.lowering._captured import Captured
    from tpudist.compile._torch.train._plan import Layout, Plan


class Stacking:
    """Runs of layout entries stored stacked: `groups[g]` are the layout positions of one parameter
    of layers 0..L-1; `rows[i]` = (the run's first position, which holds the stack; i's row)."""

    def __init__(self, groups: list[list[int]], mesh: Any, specs: list[P]):
        self.groups, self.mesh = groups, mesh
        self.rows = {i: (group[0], row) for group in groups for row, i in enumerate(group)}
        self.layer_specs = list(specs)  # per layout entry, one layer's layout
        self.specs = list(specs)        # per layout entry, its layout in the step's arguments
        for group in groups:
            self.specs[group[0]] = P(STAGE_AXIS, *specs[group[0]])

    def describe(self, model: torch.nn.Module, layout: "Layout", specs: dict[str, P]) -> dict[str, P]:
        """`TrainStep.shardings()`: each run's parameters under one name, the layer number as `*`."""
        names = {id(p): name for name, p in model.named_parameters()}
        out = dict(specs)
        for group in self.groups:
            layer_names = [names[id(layout.entries[i].param)] for i in group]
            for name in layer_names:
                out.pop(name, None)
            out[_stacked_name(layer_names)] = self.specs[group[0]]
        return out

    def stack(self, params: list[Any], states: list[tuple]) -> tuple[list[Any], list[tuple]]:
        """Per layout entry arrays -> the step's (each run's stack at its first entry, None at the others)."""
        params, states = list(params), list(states)
        for group in self.groups:
            first = group[0]
            pack = _stack(NamedSharding(self.mesh, self.specs[first]))
            params[first] = pack(*[params[i] for i in group])
            states[first] = tuple(pack(*[states[i][k] for i in group]) for k in range(len(states[first])))
            for i in group[1:]:
                params[i], states[i] = None, ()
        return params, states

    def unstack(self, params: list[Any], states: list[tuple]) -> tuple[list[Any], list[tuple]]:
        """`stack`'s inverse: each layer's arrays laid out as one layer's."""
        params, states = list(params), list(states)
        for group in self.groups:
            first = group[0]
            cut = _unstack(NamedSharding(self.mesh, self.layer_specs[first]), len(group))
            stacked_states = states[first]
            for i, value in zip(group, cut(params[first])):
                params[i] = value
            per_field = [cut(field) for field in stacked_states]
            for row, i in enumerate(group):
                states[i] = tuple(field[row] for field in per_field)
        return params, states


@functools.lru_cache(maxsize=None)
def _stack(sharding: NamedSharding) -> Any:
    return jax.jit(lambda *rows: jax.numpy.stack(rows), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _unstack(sharding: NamedSharding, count: int) -> Any:
    return jax.jit(lambda stack: [stack[i] for i in range(count)], out_shardings=[sharding] * count)


def stage_groups(captured: "Captured", plan: "Plan", layout: "Layout", stages: int,
                 names: dict[int, str] | None = None) -> list[list[int]]:
    """The layout positions of each parameter of the pipelined run of layers (see the module
    docstring), in layer order; ValueError naming the parameter where the layers cannot be stored
    stacked (trained in some layers, not in others; different optimizer settings)."""
    from tpudist.compile._torch.train._plan import Feed
    nodes = list(captured.graph.nodes)
    scan = check_scan(pipelined_scan(find_scans([n for n in nodes if n.op == "call_function"], min_layers())),
                      stages)
    placeholders = [n for n, slot in zip((n for n in nodes if n.op == "placeholder"), captured.inputs)
                    if slot.kind != "literal"]
    source = dict(zip(placeholders, plan.slots))
    trained = set(plan.trainable)
    groups = []
    for first, values in scan.stacked.items():
        sources = [source.get(v) for v in values]
        params = [s.index for s in sources if s is not None and s.kind == Feed.PARAM]
        if not params:
            continue  # buffers or constants per layer: stacked inside the step, as an unpipelined scan does
        param = layout.entries[params[0]].param
        name = (names or {}).get(id(param), f"parameter {tuple(param.shape)}")
        if len(params) != len(values) or not all(i in trained for i in params):
            raise ValueError(f"pipeline parallelism: {name} is trained in some of the layers of "
                             f"{scan.container.removeprefix('traced.')} and not in others; the stages hold each "
                             "parameter of all layers as one array: train all of them or none")
        entries = [layout.entries[i] for i in params]
        if len({(e.config, e.group) for e in entries}) != 1:
            raise ValueError(f"pipeline parallelism: the layers' copies of {name} are in different optimizer param "
                             "groups or take different settings; put every layer's copy in one group")
        groups.append(params)
    return groups


def layer_groups(captured: "Captured", plan: "Plan", layout: "Layout") -> list[list[int]]:
    """The layout positions of each parameter the step can hand a run's scan stacked (one device, see
    `_signature._pooled`), in layer order: every layer's copy a distinct parameter of one shape, dtype,
    param group and update rule, trained in all layers or in none. Others are stacked inside the scan."""
    from tpudist.compile._torch.train._plan import Feed
    trained = set(plan.trainable)
    groups = []
    for run in captured.layer_runs:
        sources = [plan.slots[i] for i in run]
        positions = [s.index for s in sources if s.kind == Feed.PARAM]
        if len(positions) != len(run) or len(set(positions)) != len(positions):
            continue
        entries = [layout.entries[i] for i in positions]
        params = [e.param for e in entries]
        if len({(e.config, e.group, e.sharded, p.shape, p.dtype) for e, p in zip(entries, params)}) != 1 \
                or len({i in trained for i in positions}) != 1:
            continue
        groups.append(positions)
    return groups


def _stacked_name(names: list[str]) -> str:
    """"layers.0.w", "layers.1.w", ... -> "layers.*.w" (the first place the names differ)."""
    first = names[0].split(".")
    differ = [k for k in range(len(first)) if len({n.split(".")[k] for n in names}) > 1]
    return ".".join("*" if k in differ else part for k, part in enumerate(first))
