"""Repeated layers: runs of identical submodules in a captured graph, to be lowered as one `lax.scan`.

A transformer's layers (`model.layers.0`, `model.layers.1`, ...) are the same computation on
different weights. Lowered node by node, the program, and XLA's compile time, grow with depth. Lowered
as one `lax.scan` over the layers' stacked weights, the body is traced and compiled once, and the
compile time stays nearly flat in depth (as MaxText and torchax's `ScannedModule` do by hand).

`find_scans` finds them in the graph itself, with no knowledge of any model: the nodes of each child
`container.<i>` of a module list (from torch.export's `nn_module_stack`), runs of consecutive children
whose nodes match op for op (same targets, same literal arguments, same shapes and dtypes), and for each
outside value a layer reads, its role across the run:

- shared: every layer reads the same node (an attention mask, rotary tables);
- stacked: each layer reads its own node, computed before the run (its weights), scanned over;
- carried: layer i+1 reads what layer i computed (the hidden state), with layer 0's input as the start.

Anything else (a layer reading a value two layers back, a value computed between layers and fed to the
next) leaves the run to be lowered node by node, as before. The layers' values read after the run
(the last hidden state, a key/value cache) come out of the scan stacked, one row per layer.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tpudist.compile._torch.lowering._custom_grad import REMAT

MIN_LAYERS_ENV = "TPUDIST_SCAN_LAYERS"  # the fewest identical layers lowered as a scan; 0 turns scanning off
DEFAULT_MIN_LAYERS = 2
_CHILD = re.compile(r"^(.*)\.(\d+)$")


def min_layers() -> int:
    text = os.environ.get(MIN_LAYERS_ENV, "")
    if not text:
        return DEFAULT_MIN_LAYERS
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{MIN_LAYERS_ENV}={text!r}: expected the fewest identical layers to scan (an int >= 2), "
                         "or 0 to lower every layer on its own") from None
    if value != 0 and value < 2:
        raise ValueError(f"{MIN_LAYERS_ENV}={text!r}: a scan needs at least 2 layers; 0 turns scanning off")
    return value


@dataclass(eq=False)
class Scan:
    """A run of identical layers. `layers[i][k]` is layer i's k-th node; layer 0's nodes are the body."""

    layers: list[list[torch.fx.Node]]
    container: str = ""  # the module list's path in the traced module (e.g. "traced.transformer.h")
    shared: list[torch.fx.Node] = field(default_factory=list)
    # layer 0's outside input -> each layer's node for it (stacked and scanned over)
    stacked: dict[torch.fx.Node, list[torch.fx.Node]] = field(default_factory=dict)
    # layer 0's outside input (the start) -> the index in a layer of the node the next layer reads instead
    carried: dict[torch.fx.Node, int] = field(default_factory=dict)
    outputs: list[int] = field(default_factory=list)  # indices of the nodes read after the run
    remat: bool = False  # the layers are (inside) torch.utils.checkpoint regions: the body is rematerialized

    @property
    def body(self) -> list[torch.fx.Node]:
        return self.layers[0]

    def members(self) -> set[torch.fx.Node]:
        return {node for layer in self.layers for node in layer}


PATHS = "tpudist_module_paths"  # node.meta["custom"] key: the module paths a traced graph's node ran in
_DYNAMO_INDEX = re.compile(r"\[(\d+)\]")


def module_paths(node: torch.fx.Node) -> list[str]:
    """The module paths a node runs inside, outermost first: torch.export's `nn_module_stack`, or
    for a graph dynamo traced, the paths `annotated` carried over."""
    custom = (node.meta.get("custom") or {}).get(PATHS)
    if custom:
        return list(custom)
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if isinstance(path, str)]


def annotated(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """A forward for a graph dynamo traced that runs its nodes one by one, each under its module paths
    (`L['self'].layers[3]` -> `layers.3`) as a trace annotation. Exported, the graph has no submodules
    to name its layers by; the annotation survives export and decomposition into every node it makes,
    so `find_scans` sees the layers as in a module's own capture."""
    paths = {}
    for node in gm.graph.nodes:
        found = tuple(_DYNAMO_INDEX.sub(r".\1", path).removeprefix("L['self']").removeprefix(".")
                      for path, _ in (node.meta.get("nn_module_stack") or {}).values() if isinstance(path, str))
        if found:
            paths[node] = found

    class Annotated(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            if node not in paths:
                return super().run_node(node)
            with torch.fx.traceback.annotate({PATHS: paths[node]}):
                return super().run_node(node)

    return lambda *args: Annotated(gm).run(*args)


def find_scans(nodes: list[torch.fx.Node], fewest: int) -> list[Scan]:
    """The runs of at least `fewest` identical layers among `nodes` (a graph's call_function nodes in
    order), outermost module lists first, each node in at most one run."""
    if fewest < 2:
        return []
    positions = {node: i for i, node in enumerate(nodes)}
    children: dict[str, dict[int, list[torch.fx.Node]]] = {}
    for node in nodes:
        for path in module_paths(node):
            found = _CHILD.match(path)
            if found:
                children.setdefault(found.group(1), {}).setdefault(int(found.group(2)), []).append(node)
    scans: list[Scan] = []
    taken: set[torch.fx.Node] = set()
    for container in sorted(children, key=lambda p: p.count(".")):
        indexed = children[container]
        order = [indexed[i] for i in sorted(indexed) if not taken.intersection(indexed[i])]
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and _same_ops(order[start], order[end]):
                end += 1
            if end - start >= fewest:
                scan = _classify(order[start:end], positions)
                if scan is not None:
                    scan.container = container
                    scans.append(scan)
                    taken |= scan.members()
            start = end
    return scans


def _same_ops(first: list[torch.fx.Node], other: list[torch.fx.Node]) -> bool:
    if len(first) != len(other):
        return False
    index = {node: k for k, node in enumerate(first)}
    index_other = {node: k for k, node in enumerate(other)}
    for a, b in zip(first, other):
        if a.target != b.target or not _same_value(a.meta.get("val"), b.meta.get("val")):
            return False
        if (REMAT in (a.meta.get("custom") or {})) != (REMAT in (b.meta.get("custom") or {})):
            return False
        if not _same_args((a.args, a.kwargs), (b.args, b.kwargs), index, index_other):
            return False
    return True


def _same_args(a: Any, b: Any, index: dict, index_other: dict) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            return False
        if (a in index) != (b in index_other):
            return False
        return index[a] == index_other[b] if a in index else _same_value(a.meta.get("val"), b.meta.get("val"))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y, index, index_other) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k], index, index_other) for k in a)
    if isinstance(a, float):
        return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))  # NaN, -0.0
    return a == b


def _same_value(a: Any, b: Any) -> bool:
    """Same shape and dtype (tensors), same structure, equal Python values (symbolic sizes never)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and all(type(x) is int for x in (*a.shape, *b.shape)) and tuple(a.shape) == tuple(b.shape))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(
            b, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _outside_reads(layer: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Every read of a node outside `layer`, in the order its nodes read them (repeats kept)."""
    inside = set(layer)
    return [value for node in layer for value in node.all_input_nodes if value not in inside]


def _classify(layers: list[list[torch.fx.Node]], positions: dict) -> Scan | None:
    """The run as a Scan, or None when some value does not fit the shared/stacked/carried roles."""
    start = min(positions[layer[0]] for layer in layers)
    members = {node: (i, k) for i, layer in enumerate(layers) for k, node in enumerate(layer)}
    first_reads = _outside_reads(layers[0])
    per_layer: list[dict[torch.fx.Node, torch.fx.Node]] = []
    for layer in layers:
        reads = _outside_reads(layer)
        if len(reads) != len(first_reads):
            return None
        forward: dict[torch.fx.Node, torch.fx.Node] = {}
        backward: dict[torch.fx.Node, torch.fx.Node] = {}
        for a, b in zip(first_reads, reads):  # one-to-one at every read, or the layers differ in wiring
            if forward.setdefault(a, b) is not b or backward.setdefault(b, a) is not a:
                return None
        per_layer.append(forward)
    scan = Scan(layers)
    for first in dict.fromkeys(first_reads):
        values = [mapping[first] for mapping in per_layer]
        if positions.get(first, -1) >= start:
            return None  # computed inside the run's span: it cannot be an input of the scan
        if all(v is first for v in values):
            scan.shared.append(first)
        elif all(v not in members and positions.get(v, -1) < start and _is_tensor(v) for v in values):
            scan.stacked[first] = values
        elif all(members.get(v, (-1, -1))[0] == i - 1 for i, v in enumerate(values) if i):
            carried = {members[v][1] for v in values[1:]}
            if len(carried) != 1:
                return None
            scan.carried[first] = carried.pop()
            if not _same_value(first.meta.get("val"), layers[0][scan.carried[first]].meta.get("val")):
                return None  # the start is not shaped as what a layer hands the next
        else:
            return None
    read_after = {members[node][1] for node in members for user in node.users if user not in members}
    scan.outputs = sorted(read_after)
    scan.remat = any(REMAT in (node.meta.get("custom") or {}) for node in layers[0])
    return scan


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
