"""Decomposing a run of identical layers once.

torch.export's graph holds every layer of a model, and decomposing it to core ATen traces every
node again: a cost that grows with depth (a 12-layer GPT-2 takes 3.4x the 2-layer one's). The
layers of a run `_layers.find_scans` finds are the same computation op for op (same ops, literals,
shapes, dtypes and wiring), so the first layer's decomposition is every layer's, with its inputs
swapped:

- `collapse`, before the decomposition, marks the first layer's outside reads and the values read
  after it (`tpudist::layer_mark`), and replaces every later layer by one `tpudist::layer` node: that
  layer's outside reads in (in the first layer's order), the values read after it out;
- `expand`, after it, copies the first layer's decomposed nodes once per `tpudist::layer` node, wired
  to that layer's reads, each copy under that layer's module path, and drops the marks.

The graph is then node for node what decomposing every layer gives. A run is decomposed layer by
layer, as before, where its layers read or give anything but tensors, write in place to what they
read (BatchNorm's running statistics), hold a higher-order op, lie in a checkpointed region, or
give a value that a later node writes in place: one node standing for a layer would lose the write.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from tpudist.compile._torch._custom_ops import LAYER, LAYER_MARK
from tpudist.compile._torch.lowering._layers import PATHS, Scan, find_scans, min_layers, module_paths

_MIN_LAYERS = 3  # with two, the one collapsed layer saves less than the marks cost


@dataclass(frozen=True)
class Run:
    """A collapsed run: its layers are `<container>.<start + i>`."""

    container: str
    start: int

    @property
    def name(self) -> str:
        return f"{self.container}.{self.start}"


def collapse(gm: torch.fx.GraphModule) -> list[Run]:
    """Marks and collapses every run of at least three identical layers of `gm`'s graph (see the module
    docstring); the runs collapsed. The caller recompiles `gm`."""
    if min_layers() == 0:  # TPUDIST_SCAN_LAYERS=0: every layer on its own
        return []
    graph = gm.graph
    runs = [Run(container, int(start))  # the runs torch.export traced once (`_siblings`)
            for container, start in (name.rsplit(".", 1) for name in
                                     dict.fromkeys(n.args[0] for n in graph.nodes if n.target is LAYER))]
    stood_in = tuple(run.container + "." for run in runs)
    nodes = [n for n in graph.nodes if n.op == "call_function"
             and not any(p.startswith(stood_in) for p in module_paths(n))]
    for scan in find_scans(nodes, _MIN_LAYERS):
        start = _index(scan.body[0], scan.container)
        if scan.remat or start is None:
            continue
        run = Run(scan.container, start)
        if _collapse_run(graph, scan, run):
            runs.append(run)
    return runs


def expand(gm: torch.fx.GraphModule, runs: list[Run]) -> None:
    """Replaces every `tpudist::layer` node of `gm`'s decomposed graph by a copy of its run's first
    layer, then drops the marks; recompiles `gm`."""
    if not runs:
        return
    graph = gm.graph
    for run in runs:
        region, marks_in, marks_out = _first_layer(graph, run)
        for op in [n for n in graph.nodes if n.target is LAYER and n.args[0] == run.name]:
            _copy_layer(graph, op, region, marks_in, marks_out, run)
    for node in [n for n in graph.nodes if n.target is LAYER_MARK]:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    if any(n.target is LAYER for n in graph.nodes):
        raise AssertionError("tpudist: a collapsed layer was left unexpanded (a bug in tpudist; "
                             "TPUDIST_SCAN_LAYERS=0 turns layer runs off)")
    graph.lint()
    gm.recompile()


# -- collapse -----------------------------------------------------------------------------------------

def _collapse_run(graph: torch.fx.Graph, scan: Scan, run: Run) -> bool:
    first = scan.body
    if writes_into(first, set(_reads(first)), opaque=True):
        return False  # (e.g. BatchNorm's running statistics written in place: a mark would take the write)
    reads = _reads(first)
    outs = sorted({k for layer in scan.layers for members in [set(layer)] for k, node in enumerate(layer)
                   for user in node.users if user not in members})
    if not all(_is_tensor(v) for v in reads) or not all(_is_tensor(first[k]) for k in outs):
        return False
    live = live_nodes(graph)
    inside = set(first)
    if not all(any(user in live and user not in inside for user in first[k].users) for k in outs):
        return False  # (the decomposition would drop the first layer's copy of a value only later layers give)
    for layer in scan.layers[1:]:
        if len(_reads(layer)) != len(reads):
            return False
    members = scan.members()
    later = [n for n in graph.nodes if n.op == "call_function" and n not in members]
    if writes_into(later, {layer[k] for layer in scan.layers for k in outs}, opaque=False):
        return False  # (one node standing for a layer would not carry the write back to what it aliases)
    with graph.inserting_before(first[0]):
        for slot, value in enumerate(reads):
            mark = graph.call_function(LAYER_MARK, (value, run.name, "in", slot))
            mark.meta = {"val": value.meta["val"], "nn_module_stack": first[0].meta.get("nn_module_stack", {})}
            for node in first:
                node.replace_input_with(value, mark)
    for k in outs:
        node = first[k]
        with graph.inserting_after(node):
            mark = graph.call_function(LAYER_MARK, (node, run.name, "out", k))
        mark.meta = {"val": node.meta["val"], "nn_module_stack": node.meta.get("nn_module_stack", {})}
        node.replace_all_uses_with(mark, delete_user_cb=lambda user, m=mark: user not in inside and user is not m)
    spec = repr([_describe(first[k].meta["val"]) for k in outs])
    for i, layer in enumerate(scan.layers[1:], start=1):
        members = set(layer)
        with graph.inserting_before(layer[0]):
            op = graph.call_function(LAYER, (run.name, i, spec, _reads(layer)))
            op.meta = {"nn_module_stack": layer[0].meta.get("nn_module_stack", {})}
            gets = [graph.call_function(operator.getitem, (op, j)) for j in range(len(outs))]
        for get, k in zip(gets, outs):
            get.meta = {"val": layer[k].meta["val"]}
            layer[k].replace_all_uses_with(get, delete_user_cb=lambda user: user not in members)
        for node in reversed(layer):
            graph.erase_node(node)
    return True


def _reads(layer: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes outside `layer` it reads, once each, in the order its nodes first read them."""
    inside = set(layer)
    return list(dict.fromkeys(v for node in layer for v in node.all_input_nodes if v not in inside))


def writes_into(nodes: list[torch.fx.Node], values: set[torch.fx.Node], opaque: bool) -> bool:
    """Whether one of `nodes` (in graph order) writes in place to one of `values` or to a view of
    one. An op whose schema does not say (a higher-order op) counts as a write: to what it reads, or
    with `opaque` to anything."""
    aliases = set(values)  # `values` and the nodes that may be views of them
    for node in nodes:
        if node.target is operator.getitem:
            if node.args[0] in aliases:
                aliases.add(node)
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            if opaque or any(v in aliases for v in node.all_input_nodes):
                return True
            continue
        given = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
        for argument in schema.arguments:
            read = given.get(argument.name)
            read = read if isinstance(read, (list, tuple)) else [read]
            if argument.alias_info is not None and any(v in aliases for v in read if isinstance(v, torch.fx.Node)):
                if argument.alias_info.is_write:
                    return True
                aliases.add(node)
    return False


def live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's outputs or an effect depend on: those a dead-code pass keeps."""
    stack = [n for n in graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure())]
    live: set[torch.fx.Node] = set(stack)
    while stack:
        for value in stack.pop().all_input_nodes:
            if value not in live:
                live.add(value)
                stack.append(value)
    return live


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _describe(value: torch.Tensor) -> tuple:
    return tuple(value.shape), tuple(value.stride()), str(value.dtype).removeprefix("torch."), str(value.device)


def _index(node: torch.fx.Node, container: str) -> int | None:
    for path in module_paths(node):
        if path.startswith(container + "."):
            head = path[len(container) + 1:].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


# -- expand -------------------------------------------------------------------------------------------

def _first_layer(graph: torch.fx.Graph, run: Run) -> tuple[list[torch.fx.Node], dict, dict]:
    """The decomposed first layer's nodes in graph order (those under its module path, and any
    node computed from its marked reads before its marked outputs), its in and out marks by slot."""
    marks_in = {n.args[3]: n for n in graph.nodes if n.target is LAYER_MARK and n.args[1] == run.name
                and n.args[2] == "in"}
    marks_out = {n.args[3]: n for n in graph.nodes if n.target is LAYER_MARK and n.args[1] == run.name
                 and n.args[2] == "out"}
    derived: set[torch.fx.Node] = set()
    stack = list(marks_in.values())
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in derived and not (user.target is LAYER_MARK and user.args[2] == "out"):
                derived.add(user)
                stack.append(user)
    prefix = run.name
    labelled = {n for n in graph.nodes if n.op == "call_function" and n.target is not LAYER_MARK
                and any(p == prefix or p.startswith(prefix + ".") for p in module_paths(n))}
    if not derived <= labelled:
        raise AssertionError(f"tpudist: the decomposition of {prefix} computes from its inputs outside its module "
                             "path (a bug in tpudist; TPUDIST_SCAN_LAYERS=0 turns layer runs off)")
    return [n for n in graph.nodes if n in labelled], marks_in, marks_out


def _copy_layer(graph: torch.fx.Graph, op: torch.fx.Node, region: list[torch.fx.Node], marks_in: dict,
                marks_out: dict, run: Run) -> None:
    _, index, _, reads = op.args
    old, new = f"{run.container}.{run.start}", f"{run.container}.{run.start + index}"
    env: dict[torch.fx.Node, torch.fx.Node] = {mark: reads[slot] for slot, mark in marks_in.items()}
    with graph.inserting_before(op):
        for node in region:
            copy = graph.node_copy(node, lambda x: env.get(x, x))
            copy.meta = _moved(node.meta, old, new)
            env[node] = copy
    values = [env.get(marks_out[k].args[0]) for k in sorted(marks_out)]
    if any(v is None for v in values):
        raise AssertionError(f"tpudist: {new}: an output of the collapsed layer is not in {old}'s decomposition "
                             "(a bug in tpudist; TPUDIST_SCAN_LAYERS=0 turns layer runs off)")
    for user in list(op.users):
        user.replace_all_uses_with(values[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(op)


def _moved(meta: dict, old: str, new: str) -> dict:
    """A copy of a first-layer node's meta under the other layer's module path."""
    def move(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path
    meta = dict(meta)
    if "nn_module_stack" in meta:
        meta["nn_module_stack"] = {key: (move(path), kind) if isinstance(path, str) else (path, kind)
                                   for key, (path, kind) in meta["nn_module_stack"].items()}
    custom = meta.get("custom")
    if custom and PATHS in custom:
        meta["custom"] = {**custom, PATHS: tuple(move(p) for p in custom[PATHS])}
    return meta
