"""Data-dependent models: capture with the real inputs' values, specialise on them, guard them.

XLA runs one executable of static shapes, so a value computed from the inputs (a label count, a
`labels.max()` check, `nonzero()`'s length) must be fixed at capture. When plain torch.export stops
at such a value, the forward is exported again with real-tensor propagation (what `draft_export`
does): torch decides each data-dependent branch with the real values and records it as a run-time
assertion. Those assertions, and the length of every data-dependent-shape result (`nonzero`,
`masked_select`, `x[mask]`, then made static: `nonzero_static` of the observed length), become a `Guard`: a
small torch program over the user's inputs, run on the host before each call; a value that changed
makes the caller capture again (counted in `stats.recaptures`). Values a guard would need the
parameters for (a branch on activations) cannot be checked before the call: a CaptureError names
the line in the user's model and the rewrite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import InputKind

from tpudist.compile._torch.lowering._captured import CaptureError, module_path
from tpudist.compile._torch.lowering._outputs import FlatOutputs

aten = torch.ops.aten
_SHAPED = (aten.nonzero.default, aten.masked_select.default)
_ASSERT = aten._assert_scalar.default
_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def _boolean_mask(node: torch.fx.Node) -> torch.fx.Node | None:
    """The mask of `x[mask]` (aten.index.Tensor with one boolean index covering x's leading dims,
    ELECTRA's `logits.view(-1)[active_loss]`), else None."""
    if node.target is not aten.index.Tensor or len(node.args[1]) != 1 or not isinstance(node.args[1][0], torch.fx.Node):
        return None
    mask, x = node.args[1][0].meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or not isinstance(x, torch.Tensor):
        return None
    return node.args[1][0] if tuple(x.shape[:mask.ndim]) == tuple(mask.shape) else None


def _shaped(node: torch.fx.Node) -> bool:
    """Whether `node` is an op of data-dependent length that the capture makes static."""
    return node.target in _SHAPED or _boolean_mask(node) is not None


def has_data_dependent_length(program: torch.export.ExportedProgram) -> bool:
    """Whether a plain export left an op of data-dependent length the capture can make static
    (torch.export traces `x[mask]` with an unbacked length when nothing branches on it)."""
    return any(_shaped(n) for gm in program.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
               for n in gm.graph.nodes if n.op == "call_function")  # (autocast regions are submodules)


@dataclass
class Guard:
    """The values one capture specialised on, and the host program that recomputes them."""

    program: torch.fx.GraphModule   # user-input leaves (by `leaves`) -> [conditions..., lengths...]
    leaves: list[int]               # which flattened (args, kwargs) leaf feeds each placeholder
    conditions: int                 # how many leading outputs are run-time assertions (must be True)
    lengths: list[int]              # the observed lengths of the data-dependent-shape results
    where: list[str]                # the user's line for each output (for the recapture warning)

    def holds(self, leaves: list[Any], parts: int = 1) -> bool:
        """Whether these inputs give the values the capture specialised on (1 small torch program),
        in each of `parts` equal row slices (the fused step's per-device batches)."""
        for part in range(parts):
            inputs = [_rows(leaves[i], part, parts) for i in self.leaves]
            with torch.no_grad():
                values = self.program(*inputs)
            if not all(bool(v) for v in values[:self.conditions]):
                return False
            if [_length(v) for v in values[self.conditions:]] != self.lengths:
                return False
        return True


def recaptured(stats: Any, guard: Guard, name: str) -> None:
    """Counts a capture again for changed data-dependent values; warns when it happens often."""
    stats.recaptures += 1
    if stats.recaptures in (RECAPTURE_WARNING, 10 * RECAPTURE_WARNING):
        warnings.warn(f"tpudist: {name} was captured and compiled again {stats.recaptures} times because a "
                      f"value computed from its inputs changed (at {', '.join(sorted(set(guard.where)))}); each "
                      "capture costs a compile. Keep those values fixed (pad to a fixed length, a fixed number "
                      "of labels) or compute them with static shapes (torch.where, masks).", stacklevel=3)


RECAPTURE_WARNING = 8  # recaptures before the warning (then again at 10x)


def _rows(value: Any, part: int, parts: int) -> Any:
    if parts == 1 or not isinstance(value, torch.Tensor) or not value.ndim:
        return value
    size = value.shape[0] // parts
    return value[part * size:(part + 1) * size]


def is_data_dependent(exc: BaseException) -> bool:
    """Whether torch.export stopped at a value computed from the inputs."""
    while exc is not None:
        name = type(exc).__name__
        if name in ("GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def export_observed(flat: torch.nn.Module, args: tuple, kwargs: dict, name: str,
                    program: torch.export.ExportedProgram | None = None) -> tuple[torch.export.ExportedProgram, Guard]:
    """torch.export with the real values deciding data-dependent branches; the graph made static.
    `name` (e.g. "Net.forward") opens the CaptureError of a value no guard can check. `program`: a
    plain export that went through with a data-dependent length (`x[mask]` that nothing branches
    on), specialised as it is (torch's real-value propagation fails on some of those)."""
    with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True), quiet():
        if program is None:
            program = torch.export.export(flat, args, kwargs, strict=False)
        if any(n.target is _AUTOCAST for n in program.graph.nodes):
            # an autocast region is a submodule the guard cannot reach into: its casts made explicit
            # (what the capture's decomposition does anyway), the data-dependent ops come to the top
            program = program.run_decompositions({})
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))]
    try:
        guard = _guard(program, leaves)
    except CaptureError as exc:
        raise CaptureError(str(exc).replace("torch -> XLA: ", f"torch -> XLA: {name}: ", 1)) from None
    _make_static(program, guard.lengths)
    return program, guard


@contextlib.contextmanager
def quiet() -> Any:
    """torch logs each value it decided with the real tensors (a warning per branch, on every rank)."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _guard(program: torch.export.ExportedProgram, leaves: list[Any]) -> Guard:
    graph = program.graph
    conditions = [n.args[0] for n in graph.nodes if n.target is _ASSERT and isinstance(n.args[0], torch.fx.Node)]
    shaped = [n for n in graph.nodes if _shaped(n)]
    roots = conditions + shaped
    # x[mask]'s length is the mask's count: the guard computes nonzero(mask), never x (often activations)
    masks = {n: m for n in shaped if (m := _boolean_mask(n)) is not None}
    needed = _ancestors(roots, masks)
    specs = program.graph_signature.input_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    leaf_of, leaf = {}, 0
    for node, spec in zip(placeholders, specs):
        if spec.kind == InputKind.USER_INPUT:
            leaf_of[node] = leaf
            leaf += 1
        elif node in needed and spec.kind != InputKind.CONSTANT_TENSOR:
            raise CaptureError(_needs_state_message(roots, node, spec))
    drawn = next((n for n in needed if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())), None)
    if drawn is not None:
        raise CaptureError(_random_message(roots, drawn))
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    used_leaves = []
    for node in graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node not in leaf_of:  # a lifted constant (not passed to the guard: refused)
                raise CaptureError(_needs_state_message(roots, node, None))
            env[node] = new.placeholder(node.name)
            used_leaves.append(leaf_of[node])
        elif node in masks:  # its rows: as many as nonzero(mask)'s
            env[node] = new.call_function(aten.nonzero.default, (env[masks[node]],))
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    new.output([env[n] for n in roots])
    module = torch.fx.GraphModule(torch.nn.Module(), new)
    observed = Guard(module, used_leaves, len(conditions), [], [user_line(n) for n in roots])
    with torch.no_grad():
        values = module(*[leaves[i] for i in used_leaves]) if roots else []
    observed.lengths = [_length(v) for v in values[len(conditions):]]
    return observed


def _make_static(program: torch.export.ExportedProgram, lengths: list[int]) -> None:
    """Replaces the data-dependent-shape ops by static ones of the observed lengths, drops the
    assertions (the guard checks them)."""
    gm = program.graph_module
    graph = gm.graph
    shaped = [n for n in graph.nodes if _shaped(n)]
    for node, size in zip(shaped, lengths):
        with graph.inserting_before(node):
            mask = _boolean_mask(node)
            if mask is not None:  # x[mask]: x's leading dims flattened, the observed rows selected
                x = node.args[0]
                rest = list(x.meta["val"].shape[mask.meta["val"].ndim:])
                flat_x = graph.call_function(aten.reshape.default, (x, [-1, *rest]))
                flat_mask = graph.call_function(aten.reshape.default, (mask, [-1]))
                where = graph.call_function(aten.nonzero_static.default, (flat_mask,), {"size": size})
                index = graph.call_function(aten.reshape.default, (where, [-1]))
                static = graph.call_function(aten.index_select.default, (flat_x, 0, index))
            elif node.target is aten.nonzero.default:
                static = graph.call_function(aten.nonzero_static.default, (node.args[0],), {"size": size})
            else:
                x, mask = node.args  # masked_select broadcasts x and mask against each other
                shape = list(torch.broadcast_shapes(x.meta["val"].shape, mask.meta["val"].shape))
                x = graph.call_function(aten.expand.default, (x, shape))
                mask = graph.call_function(aten.expand.default, (mask, shape))
                flat_mask = graph.call_function(aten.reshape.default, (mask, [-1]))
                where = graph.call_function(aten.nonzero_static.default, (flat_mask,), {"size": size})
                index = graph.call_function(aten.reshape.default, (where, [-1]))
                flat_x = graph.call_function(aten.reshape.default, (x, [-1]))
                static = graph.call_function(aten.index_select.default, (flat_x, 0, index))
        static.meta = {k: v for k, v in node.meta.items() if k != "val"}
        node.replace_all_uses_with(static)
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.target is _ASSERT:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()


def _ancestors(roots: list[torch.fx.Node], masks: dict[torch.fx.Node, torch.fx.Node] | None = None) -> set[torch.fx.Node]:
    """Every node `roots` are computed from; an `x[mask]` in `masks` only from its mask."""
    masks = masks or {}
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend([masks[node]] if node in masks else node.all_input_nodes)
    return seen


def _length(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.ndim else int(value.numel())


_LIBRARY_ROOTS = tuple(f"{p}{os.sep}" for p in (Path(torch.__file__).parent, Path(__file__).parents[3]))


def user_line(node: torch.fx.Node) -> str:
    """The last frame of the user's code (not torch's) that made `node`, as "file:line"."""
    text = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    frames = [line for line in lines if not any(f'"{root}' in line for root in _LIBRARY_ROOTS)]
    if not frames:
        return module_path(node)
    parts = frames[-1].split('"')
    number = frames[-1].split("line ")[-1].split(",")[0]
    return f"{parts[1]}:{number}" if len(parts) > 1 else frames[-1]


def _random_message(roots: list[torch.fx.Node], drawn: torch.fx.Node) -> str:
    needs = [r for r in roots if drawn in _ancestors([r])] or roots
    return (f"torch -> XLA: the branch at {user_line(needs[0])} depends on a random number ({drawn.target} at "
            f"{user_line(drawn)}); a compiled step would take the branch drawn once, at capture, every time. "
            "Compute both branches and choose with torch.where(torch.rand(()) < p, a, b), or turn that randomness "
            "off (LayerDrop: layerdrop=0.0).")


def _needs_state_message(roots: list[torch.fx.Node], node: torch.fx.Node, spec: Any) -> str:
    needs = [r for r in roots if node in _ancestors([r])] or roots
    what = f"parameter or buffer '{spec.target.removeprefix(FlatOutputs.PREFIX)}'" if spec is not None \
        else "a model constant"
    return (f"torch -> XLA: a data-dependent value at {user_line(needs[0])} depends on {what}, so it cannot be "
            "checked before the call, and XLA compiles for static shapes and one branch. Rewrite it with "
            "torch.where (both branches computed), a mask instead of x[mask] / nonzero(), or move that part "
            "outside the compiled module.")

