"""Lowering: a captured core-ATen graph -> one JAX function, by walking it through the registry.

The function takes the graph's tensor inputs (as JAX arrays, in placeholder order, literals left
out) and a JAX PRNG key (None when the graph draws no random numbers), and returns the graph's
outputs. Traced under `jax.jit`, every op becomes XLA HLO; nothing of torch remains at run time.
A lowering that fails while tracing is an UnsupportedOpError naming the op and its module path.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpudist.compile._torch.lowering._captured import Captured, module_path
from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch.lowering._custom_grad import REMAT
from tpudist.compile._torch.lowering._layers import Scan, find_scans, min_layers
from tpudist.compile._torch.lowering._pieces import piece as _piece, sibling_pieces as _sibling_pieces
from tpudist.compile._torch.lowering._parallel import CONTEXT_AXIS, STAGE_AXIS, current, sequence_split
from tpudist.compile._torch.lowering._pipeline import Rows, check_scan, pipelined_scan, run_pipelined
from tpudist.compile._torch.lowering._registry import IGNORED_OPS, UnsupportedOpError, is_random, lookup
from tpudist.compile._torch.lowering.ops import linalg

# keyword arguments that describe torch placement or layout, meaningless to XLA
_PLACEMENT_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format", "non_blocking"})


def lower(captured: Captured, scan: bool = True,
          microbatches: int | None = None) -> Callable[[Sequence[jax.Array], Any], tuple[Any, ...]]:
    """The JAX function computing `captured`'s graph: `run(tensor_inputs, key) -> outputs`; `key` is a
    JAX PRNG key when `captured.has_random`, else ignored. `scan`: identical layers as one
    `lax.scan` (TPUDIST_SCAN_LAYERS), else each on its own (what inference wants: a scan over
    separate weight arrays stacks them, and the layers' caches, at every call).

    `microbatches=M` (pipeline parallelism, traced on a mesh with a "stage" axis): the batch inputs
    come with a leading dim of M micro-batches, a pipelined layer's parameter as a `_pipeline.Rows`
    (its row of the stack), the longest run of layers runs over the stages (`_pipeline`) and every
    output comes back per micro-batch."""
    nodes = list(captured.complete().graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    literals = {node: slot.value for node, slot in zip(placeholders, captured.inputs) if slot.kind == "literal"}
    tensor_placeholders = [n for n in placeholders if n not in literals]
    batch_nodes = [n for n, slot in zip(placeholders, captured.inputs) if slot.kind == "input"]
    pieces = _sibling_pieces(nodes)
    positions = {node: i for i, node in enumerate(nodes)}
    calls = [n for n in nodes if n.op == "call_function"]
    scans = find_scans(calls, min_layers()) if scan else []
    steps = _steps(calls, positions, scans)
    output = next(n for n in nodes if n.op == "output")

    def run(tensors: Sequence[jax.Array], key: Any) -> tuple[Any, ...]:
        assert len(tensors) == len(tensor_placeholders), (len(tensors), len(tensor_placeholders))
        layout = current()  # context parallelism: activations kept split over the sequence
        split = layout is not None and layout.sequence is not None and layout.size(CONTEXT_AXIS) > 1
        if microbatches is not None:
            env: dict[torch.fx.Node, Any] = dict(literals)
            env.update(zip(tensor_placeholders, tensors))
            staged = check_scan(pipelined_scan(scans), layout.size(STAGE_AXIS))
            return run_pipelined(steps, staged, env, batch_nodes, key, microbatches, layout,
                                 lambda step, local, k: _step(step, local, pieces, k, positions, False),
                                 lambda shared, k: _layer(staged, shared, pieces, k, positions), output.args[0], _read)
        env = _Env(literals)
        for node, tensor in zip(tensor_placeholders, tensors):
            if isinstance(tensor, Rows):
                env.rows[node] = tensor
            else:
                env[node] = tensor
        for step in steps:
            _step(step, env, pieces, key, positions, split)
        return tuple(_read(value, env) for value in output.args[0])

    return run


def _step(step: Any, env: dict, pieces: dict, key: Any, positions: dict, split: bool) -> None:
    """One lowering step: a checkpointed region, a run of layers, or one node."""
    if isinstance(step, _Region):
        env.update(zip(step.outputs, jax.checkpoint(step.evaluate(pieces, key, positions))(
            *[env[n] for n in step.inputs])))
    elif isinstance(step, Scan):
        _scan(step, env, pieces, key, positions)
    else:
        _evaluate(step, env, {}, pieces, key, positions, split)
        if split and step in env:
            env[step] = sequence_split(env[step])


def _evaluate(node: torch.fx.Node, env: dict, splits: dict, pieces: dict, key: Any, positions: dict,
              split: bool = False) -> None:
    if node in pieces:
        env[node] = _conform(_piece(pieces[node], env, splits), node)
    elif node.target is operator.getitem:
        env[node] = _conform(env[node.args[0]][node.args[1]], node)
    elif node.target not in IGNORED_OPS:
        env[node] = _apply(node, env, key, positions[node], split)


@dataclass
class _Region:
    """The nodes of one `torch.utils.checkpoint` call (marked by capture), computed as one
    `jax.checkpoint`: the backward recomputes them from the region's inputs instead of keeping
    their intermediates, as torch's checkpoint does."""

    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]

    def evaluate(self, pieces: dict, key: Any, positions: dict) -> Callable[..., tuple]:
        def region(*values: Any) -> tuple:
            env = dict(zip(self.inputs, values))
            splits: dict = {}
            for node in self.nodes:
                _evaluate(node, env, splits, pieces, key, positions)
            return tuple(env[n] for n in self.outputs)
        return region


def _scan(scan: Scan, env: dict, pieces: dict, key: Any, positions: dict) -> None:
    """A run of identical layers as one `lax.scan` (see _layers): layer 0's nodes are the body, each
    layer's weights are stacked and scanned over, the hidden state is carried."""
    rows = [_stacked(scan.stacked[node], env) for node in scan.stacked]
    step = _layer(scan, {node: env[node] for node in scan.shared}, pieces, key, positions)
    _, outputs = lax.scan(step, tuple(env[node] for node in scan.carried), (jnp.arange(len(scan.layers)), rows))
    for k, values in zip(scan.outputs, outputs):
        for i, nodes in enumerate(scan.layers):
            env[nodes[k]] = jax.tree_util.tree_map(lambda v, i=i: v[i], values)


class _Env(dict):
    """The values of a graph's nodes; a graph input given as a row of a stacked array (`Rows`: a layer's
    weight the step holds with its run's other layers) is cut out of it only where something reads it
    alone, not where the run's scan takes the whole stack (`_stacked`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.rows: dict[torch.fx.Node, Rows] = {}

    def __missing__(self, node: torch.fx.Node) -> Any:
        if node not in self.rows:
            raise KeyError(node)
        rows = self.rows[node]
        value = self[node] = rows.stack[rows.index]
        return value


def _stacked(values: list[torch.fx.Node], env: dict) -> Any:
    """The layers' values of one weight as one array, layer by layer: the step's stack itself when the
    values are its rows in order, else stacked here."""
    given = [env.rows.get(v) for v in values] if isinstance(env, _Env) else []
    if given and all(g is not None and g.stack is given[0].stack for g in given) \
            and [g.index for g in given] == list(range(given[0].stack.shape[0])):
        return given[0].stack
    return jnp.stack([env[value] for value in values])


def _layer(scan: Scan, shared: dict, pieces: dict, key: Any, positions: dict) -> Callable[[tuple, tuple], tuple]:
    """One layer of `scan` as a `lax.scan` body: (carry, (layer number, its weights)) -> (carry, outputs).
    Each layer draws its random numbers from its own key (the graph's key folded with the layer's
    number past every node's position), so no two layers' dropout masks repeat."""
    body, starts, stacked = scan.body, list(scan.carried), list(scan.stacked)
    ends = [scan.carried[node] for node in starts]

    def layer(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        index, weights = x
        local = dict(shared)
        local.update(zip(starts, carry))
        local.update(zip(stacked, weights))
        layer_key = None if key is None else jax.random.fold_in(key, len(positions) + index)
        splits: dict = {}
        for node in body:
            _evaluate(node, local, splits, pieces, layer_key, positions)
        return tuple(local[body[k]] for k in ends), tuple(local[body[k]] for k in scan.outputs)

    return jax.checkpoint(layer) if scan.remat else layer


def _steps(nodes: list[torch.fx.Node], positions: dict, scans: list[Scan]) -> list[Any]:
    """The graph's nodes in order, with each run of identical layers as one Scan (at its first node)
    and each checkpointed region's nodes gathered into one _Region where they can run as a unit
    (every input of the region computed before its first node)."""
    in_scan = {node: scan for scan in scans for node in scan.members()}
    regions: dict[int, list[torch.fx.Node]] = {}
    for node in nodes:
        mark = (node.meta.get("custom") or {}).get(REMAT)
        if mark is not None and node not in in_scan:
            regions.setdefault(mark, []).append(node)
    steps: list[Any] = []
    done: set[int] = set()
    emitted: set[int] = set()
    for node in nodes:
        mark = (node.meta.get("custom") or {}).get(REMAT)
        if node in in_scan:
            if id(in_scan[node]) not in emitted:
                emitted.add(id(in_scan[node]))
                steps.append(in_scan[node])
        elif mark is None:
            steps.append(node)
        elif mark not in done:
            done.add(mark)
            steps.extend(_region(regions[mark], positions))
    return steps


def _region(members: list[torch.fx.Node], positions: dict) -> list[Any]:
    inside = set(members)
    inputs: list[torch.fx.Node] = []
    for node in members:
        for value in node.all_input_nodes:
            if value not in inside and value not in inputs:
                inputs.append(value)
    first = positions[members[0]]
    if any(positions[v] > first for v in inputs) or any(positions[n] - first != i for i, n in enumerate(members)):
        return list(members)  # interleaved with the rest of the graph: computed node by node
    outputs = [n for n in members if any(user not in inside for user in n.users)]
    return [_Region(members, inputs, outputs)]


def _broadcast_matrix(operand: Any) -> torch.fx.Node | None:
    """The 2-D tensor that a bmm operand merely repeats over the batch, or None.

    Decomposing `linear` / `matmul` on a non-contiguous 3-D input (MultiheadAttention's input
    projection, for one) gives `bmm(x, view(expand(w, [b, k, n])))`: b small matrix products
    against one weight. One (b*m, k) x (k, n) product computes the same and is far faster on XLA."""
    node = operand
    if isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.view.default:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not torch.ops.aten.expand.default:
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if isinstance(value, torch.Tensor) and value.ndim == 2 and list(node.args[1][1:]) == list(value.shape):
        return source
    return None


def _transposed_matrix(operand: Any) -> torch.fx.Node | None:
    """The 2-D tensor `w` when a matmul operand is `w.t()` (`permute(w, [1, 0])`), else None.

    `linear` decomposes to `addmm(b, x, permute(w, [1, 0]))`. Contracting x with w's second
    dimension directly gives XLA the same product, and makes autodiff keep `w` itself for the
    backward instead of a transposed copy, which the forward would otherwise have to write out
    every step (one copy of every weight matrix)."""
    if not isinstance(operand, torch.fx.Node) or operand.target not in (
            torch.ops.aten.permute.default, torch.ops.aten.t.default):
        return None
    if operand.target is torch.ops.aten.permute.default and list(operand.args[1]) != [1, 0]:
        return None
    source = operand.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return source if isinstance(value, torch.Tensor) and value.ndim == 2 else None


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _unflattened_linear(node: torch.fx.Node, env: dict) -> Any:
    """For `view(addmm(b, view(x, (n, k)), w.t()), (*lead, m))`, the decomposition of `linear` on an
    (*lead, k) input: `x @ w.T + b` on `x` as it is, None for any other view. Used where the
    sequence is split over a "context" axis: flattening (batch, sequence) into one dim would make
    XLA's partitioner gather the sequence around every linear layer."""
    product = node.args[0]
    aten = torch.ops.aten
    if not isinstance(product, torch.fx.Node) or product.kwargs \
            or product.target not in (aten.mm.default, aten.addmm.default):
        return None
    matrix, flat = (product.args[1], product.args[0]) if product.target is aten.mm.default else product.args[2:0:-1]
    weight = _transposed_matrix(matrix)
    if weight is None or weight not in env or not isinstance(flat, torch.fx.Node) or flat.target not in _VIEWS:
        return None
    x = flat.args[0]
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.ndim < 3 or x not in env \
            or tuple(flat.meta["val"].shape) != (math.prod(value.shape[:-1]), value.shape[-1]) \
            or tuple(node.meta["val"].shape) != (*value.shape[:-1], product.meta["val"].shape[-1]):
        return None
    out = linalg.contract_last(env[x], env[weight])
    return out if product.target is aten.mm.default else linalg.with_bias(_read(product.args[0], env), out)


def _apply(node: torch.fx.Node, env: dict, key: Any, position: int, split: bool = False) -> Any:
    aten = torch.ops.aten
    if split and node.target in _VIEWS:
        unflattened = _unflattened_linear(node, env)
        if unflattened is not None:
            return _conform(unflattened, node)
    if node.target is aten.bmm.default:
        weight = _broadcast_matrix(node.args[1])
        if weight is not None and weight in env:
            return _conform(linalg.product(_read(node.args[0], env), env[weight]), node)
    elif node.target is aten.mm.default or (node.target is aten.addmm.default and not node.kwargs):
        matrix, other = (node.args[1], node.args[0]) if node.target is aten.mm.default else (node.args[2], node.args[1])
        weight = _transposed_matrix(matrix)
        a = _read(other, env)
        if weight is not None and weight in env and getattr(a, "ndim", 0) == 2:
            product = linalg.contract_last(a, env[weight])
            if node.target is aten.addmm.default:
                product = linalg.with_bias(_read(node.args[0], env), product)
            return _conform(product, node)
    lowering = lookup(node.target)
    assert lowering is not None, f"{node.target} passed capture's op check but has no lowering"
    args = [_read(a, env) for a in node.args]
    kwargs = {k: _read(v, env) for k, v in node.kwargs.items() if k not in _PLACEMENT_KWARGS}
    if is_random(node):
        args.insert(0, jax.random.fold_in(key, position))
    if lowering.input_meta:
        kwargs["meta"] = node.args[0].meta.get("val")
    try:
        result = lowering.fn(*args, **kwargs)
    except UnsupportedOpError as exc:
        raise UnsupportedOpError(f"{exc} (in {module_path(node)})") from None
    except Exception as exc:  # a lowering meeting arguments it was not written for
        raise UnsupportedOpError(
            f"torch -> XLA: lowering {node.target} (in {module_path(node)}) failed for arguments "
            f"{_describe_args(node)}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. "
            "Rewrite that part of the model with other torch ops, or keep it outside the compiled module; "
            "please report it with this message.") from exc
    if isinstance(result, (tuple, list)):
        return result  # multi-output ops are conformed element by element when read (getitem)
    return _conform(result, node)


def _describe_args(node: torch.fx.Node) -> str:
    def one(a: Any) -> str:
        value = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {value.dtype}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(one(v) for v in value) + "]"
        return repr(value)
    parts = [one(a) for a in node.args] + [f"{k}={one(v)}" for k, v in node.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _read(value: Any, env: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        return env[value]
    if isinstance(value, (list, tuple)):
        return type(value)(_read(v, env) for v in value)
    if isinstance(value, torch.dtype):
        return jax_dtype(value)
    return value


def _conform(value: Any, node: torch.fx.Node) -> Any:
    """Casts a lowering's result to the dtype torch recorded for the node, and checks its shape."""
    expected = node.meta.get("val")
    if not isinstance(expected, torch.Tensor):
        return value
    value = jnp.asarray(value)
    dtype = jax_dtype(expected.dtype)
    if value.dtype != dtype:
        value = value.astype(dtype)
    assert value.shape == tuple(expected.shape), (
        f"lowering of {node.target} ({module_path(node)}) returned shape {value.shape}, torch expects "
        f"{tuple(expected.shape)}")
    return value
