"""What a capture produced: the core-ATen graph and how to feed it (its input and output slots).

The module and train rooms read only this: which graph input is a parameter, a buffer, a lifted
constant, a user input or a literal, which outputs write buffers back, and which inputs a gradient
reaches (a parameter no gradient reaches gets `.grad = None`, as in eager torch).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.export.graph_signature import InputKind, OutputKind

from tpudist.compile._torch._custom_ops import COLLECTIVE_OPS, STOP_GRADIENT
from tpudist.compile._torch.lowering import _custom_grad
from tpudist.compile._torch.lowering._layers import find_scans, min_layers
from tpudist.compile._torch.lowering._outputs import FlatOutputs, Template
from tpudist.compile._torch.lowering._registry import UnsupportedOpError, is_random


class Slot(enum.StrEnum):
    """Where a graph input comes from, or where a graph output goes."""

    PARAM = "param"
    BUFFER = "buffer"
    CONSTANT = "constant"
    INPUT = "input"      # a user tensor input (as an output: an input the graph writes back)
    LITERAL = "literal"  # a non-tensor user input, specialised by export
    USER = "user"        # a user output
    PIECE = "piece"      # an output that rebuilds a write-back on torch's side (module/_resident.py)


class CaptureError(TypeError):
    """torch.export could not trace the module (data-dependent control flow, unsupported Python)."""


@dataclass(frozen=True)
class InputSlot:
    """One graph input."""

    kind: Slot
    name: str                 # parameter / buffer FQN, constant name, or the user input's position
    leaf: int = -1            # for 'input': index into the flattened (args, kwargs) leaves
    value: Any = None         # for 'literal' (a non-tensor user input, specialized by export)
    used: bool = True         # whether a gradient reaches it (others get none, as in torch; see _gradient_reach)
    mutated: bool = False     # whether the graph writes it back (buffers, inputs)


@dataclass(frozen=True)
class OutputSlot:
    """One graph output; target: the written FQN (BUFFER) or leaf index (INPUT)."""

    kind: Slot
    target: Any
    dtype: torch.dtype


@dataclass
class Captured:
    """The captured graph of one (input signature, train/eval mode) and its input/output plumbing."""

    graph: torch.fx.Graph
    inputs: list[InputSlot]
    outputs: list[OutputSlot]
    template: Template        # rebuilds the user's output from the graph's user outputs
    constants: dict[str, torch.Tensor]
    has_random: bool
    collective: bool = False  # holds ops that reach other processes (ShardedEmbedding's lookup)
    seconds: float = 0.0
    op_counts: dict[str, int] = field(default_factory=dict)
    # per floating user output (in output order): the tensor inputs (positions among the graph's
    # non-literal inputs) its gradient reaches
    reaches: list[frozenset[int]] = field(default_factory=list)
    # per graph output: (shape, dtype) of a tensor, else None
    output_values: list[tuple[tuple[int, ...], torch.dtype] | None] = field(default_factory=list)
    # per weight of a run of identical layers lowered as one scan (`_layers.find_scans`), read from a
    # graph input in every layer: those inputs' positions among the non-literal inputs, layer by layer
    layer_runs: list[list[int]] = field(default_factory=list)
    # the data-dependent values this capture specialised on (an `_observed.Guard`), checked per call
    guard: Any = None
    key: str | None = None     # its step cache key (`_capture_cache`), where cached
    pending: Callable[[], "Captured"] | None = None  # a cache hit's decomposition, not yet run

    # what the decomposed graph tells, kept in a step cache entry
    TOLD = ("inputs", "outputs", "has_random", "collective", "op_counts", "reaches", "output_values", "layer_runs")

    def complete(self) -> "Captured":
        """A cache hit's graph decomposed (as a miss has it), checked against the entry; a no-op
        when nothing is pending. Lowering calls it first."""
        if self.pending is not None:
            done = self.pending()
            for name in self.TOLD:
                if getattr(self, name) != getattr(done, name):
                    raise RuntimeError(
                        f"tpudist: the step cache entry {self.key}.capture (in TPUDIST_CACHE_DIR/tpudist-steps) says "
                        f"{name}={getattr(self, name)!r} but this graph's decomposition gives {getattr(done, name)!r}; "
                        "delete that file (or set TPUDIST_STEP_CACHE=0) and report it as a tpudist bug")
            self.graph, self.constants, self.pending = done.graph, done.constants, None
        return self

    @classmethod
    def from_entry(cls, entry: dict, exported: torch.export.ExportedProgram, template: Template, key: str,
                   complete: Callable[[], "Captured"]) -> "Captured":
        """The capture a step cache entry describes: its slots and flags, the exported
        (undecomposed) graph, and `complete` to decompose it when something must lower it."""
        constants = dict(exported.constants)
        constants.update(entry["constants"])
        return cls(graph=exported.graph, template=template, constants=constants, key=key, pending=complete,
                   **{name: entry[name] for name in cls.TOLD})


def module_path(node: torch.fx.Node) -> str:
    """Where a node comes from, e.g. "module 'encoder.0.attn' (MultiheadAttention)"."""
    stack = [(path, kind) for path, kind in (node.meta.get("nn_module_stack") or {}).values()
             if user_path(path) is not None]
    if not stack:
        return "the top-level forward"
    path, kind = stack[-1]
    path = user_path(path)
    kind = kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return f"module '{path}' ({kind})" if path else f"the top-level forward ({kind})"


def user_path(path: str) -> str | None:
    """A module path under the traced wrapper (FlatOutputs) as the user's module names it; None for
    the wrapper itself."""
    if path == FlatOutputs.PREFIX[:-1]:
        return ""
    return path[len(FlatOutputs.PREFIX):] if path.startswith(FlatOutputs.PREFIX) else None


def plumbing(program: torch.export.ExportedProgram, template: Template) -> Captured:
    signature = program.graph_signature
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    mutated = {_strip(spec.target) if spec.kind == OutputKind.BUFFER_MUTATION else spec.target
               for spec in signature.output_specs
               if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)}
    roots = _user_float_outputs(program, signature)
    reach = _gradient_reach([r for r in roots if r is not None])
    inputs, leaf = [], 0
    for node, spec in zip(placeholders, signature.input_specs):
        used = node in reach
        if spec.kind == InputKind.PARAMETER:
            inputs.append(InputSlot(Slot.PARAM, _strip(spec.target), used=used))
        elif spec.kind == InputKind.BUFFER:
            name = _strip(spec.target)
            inputs.append(InputSlot(Slot.BUFFER, name, used=used, mutated=name in mutated))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(InputSlot(Slot.CONSTANT, spec.target, used=used))
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, torch.export.graph_signature.ConstantArgument):
                inputs.append(InputSlot(Slot.LITERAL, spec.arg.name, leaf=leaf, value=spec.arg.value))
            else:
                inputs.append(InputSlot(Slot.INPUT, spec.arg.name, leaf=leaf, used=used,
                                        mutated=spec.arg.name in mutated))
            leaf += 1
        else:
            raise UnsupportedOpError(f"torch -> XLA: graph input {spec.arg} of kind {spec.kind.name} "
                                     "(custom objects, tokens) is not supported")
    input_leaf = {slot.name: slot.leaf for slot in inputs if slot.kind is Slot.INPUT}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    outputs = []
    for value, spec in zip(output_node.args[0], signature.output_specs):
        dtype = value.meta["val"].dtype if isinstance(value, torch.fx.Node) else None
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(OutputSlot(Slot.USER, None, dtype))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(OutputSlot(Slot.BUFFER, _strip(spec.target), dtype))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            outputs.append(OutputSlot(Slot.INPUT, input_leaf[spec.target], dtype))
        elif spec.kind == OutputKind.PARAMETER_MUTATION:
            raise CaptureError(f"torch -> XLA: the forward modifies parameter '{_strip(spec.target)}' in place "
                               "(under no_grad); the compiled module does not write parameters back. Update it "
                               "outside forward (e.g. after optimizer.step()), or keep the value in a buffer")
        else:
            raise UnsupportedOpError(f"torch -> XLA: graph output of kind {spec.kind.name} is not supported")
    tensor_placeholders = [n for n, slot in zip(placeholders, inputs) if slot.kind is not Slot.LITERAL]
    reaches = []
    for root in roots:
        if root is not None:
            reached = _gradient_reach([root])
            reaches.append(frozenset(i for i, n in enumerate(tensor_placeholders) if n in reached))
    ops = [n for n in program.graph.nodes if n.op == "call_function"]
    counts: dict[str, int] = {}
    for n in ops:
        counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    has_random = any(is_random(n) for n in ops if n.target is not operator.getitem)
    collective = any(n.target in COLLECTIVE_OPS for n in ops)
    values = [value.meta.get("val") if isinstance(value, torch.fx.Node) else None for value in output_node.args[0]]
    return Captured(graph=program.graph, inputs=inputs, outputs=outputs, template=template,
                    constants=dict(program.constants), has_random=has_random, collective=collective,
                    op_counts=counts, reaches=reaches,
                    output_values=[(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in values],
                    layer_runs=_layer_runs(ops, tensor_placeholders))


def _layer_runs(ops: list[torch.fx.Node], tensor_placeholders: list[torch.fx.Node]) -> list[list[int]]:
    """`Captured.layer_runs`: the stacked values of the scans `lower` will make that are graph inputs."""
    position = {node: i for i, node in enumerate(tensor_placeholders)}
    return [[position[v] for v in values] for scan in find_scans(ops, min_layers())
            for values in scan.stacked.values() if all(v in position for v in values)]


def _user_float_outputs(program: torch.export.ExportedProgram, signature: Any) -> list[torch.fx.Node | None]:
    """Per graph output: its node when it is a floating user output (differentiable), else None."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    return [value if spec.kind == OutputKind.USER_OUTPUT and isinstance(value, torch.fx.Node) and _floating(value)
            else None for value, spec in zip(output.args[0], signature.output_specs)]


def _gradient_reach(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes a gradient of `roots` reaches: walked back from them, stopping at values without
    gradients (integers, booleans), stop_gradient (`detach`, `no_grad`) and custom Function inputs
    whose backward returns None. A parameter outside it gets no `.grad` (None), as in eager torch,
    rather than a zero gradient an optimizer would still step with."""
    stack = list(roots)
    reach: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in reach or not _floating(node):
            continue
        reach.add(node)
        if node.target is STOP_GRADIENT:
            continue
        if node.target is _custom_grad.AUTOGRAD_FUNCTION:
            call = _custom_grad._CALLS[node.args[0]]
            stack.extend(node.args[1][i] for i in call.grad_positions)
            continue
        stack.extend(node.all_input_nodes)
    return reach


def _floating(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):  # a multi-output op: through any floating part
        return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in value)
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _strip(name: str) -> str:
    """A parameter or buffer name under the traced wrapper as the user's module names it."""
    return name[len(FlatOutputs.PREFIX):] if name.startswith(FlatOutputs.PREFIX) else name


def resolver(module: torch.nn.Module, slot: InputSlot, captured: Captured) -> Callable[[list[Any]], Any]:
    """A function reading the slot's current tensor; parameters and buffers are looked up on each
    call (one dict lookup), so reassigning `module.weight` between calls is seen."""
    if slot.kind in (Slot.PARAM, Slot.BUFFER):
        path, _, attr = slot.name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        table = owner._parameters if slot.kind is Slot.PARAM else owner._buffers
        return lambda leaves: table[attr]
    if slot.kind is Slot.CONSTANT:
        value = captured.constants[slot.name]
        return lambda leaves: value
    return lambda leaves: leaves[slot.leaf]
