"""Capture: a torch.nn.Module and example inputs -> a core-ATen graph plus how to feed it.

`torch.export` (non-strict) traces the module's forward for one input signature into an ATen
graph whose inputs are the module's parameters, buffers, lifted constants and the user's inputs,
and whose outputs are the buffer updates (BatchNorm running statistics) and the user's outputs.
Decomposing it to core ATen leaves ~200 op overloads to lower, all listed in one registry.
`scaled_dot_product_attention` is kept whole (as `tpudist::attention`), one lowering: one attention
op for XLA instead of torch's decomposition into matmuls and a softmax.

The forward is traced through `FlatOutputs`, so outputs may hold objects torch.export does not
know (a Hugging Face model's key/value cache): their tensors are graph outputs and the rest is
kept as a template (`_outputs`). An active `torch.autocast` is part of the capture: the forward is
traced inside the same autocast, so the graph holds its casts, as eager torch would run them.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_flatten

from tpudist.compile._torch._custom_ops import ATTENTION, COLLECTIVE_OPS, STOP_GRADIENT
from tpudist.compile._torch._outputs import FlatOutputs, Template
from tpudist.compile._torch._registry import (
    IGNORED_OPS,
    UnsupportedOpError,
    is_random,
    lookup,
    torch_decompositions,
    unsupported_message,
)

AUTOCAST_DEVICES = ("cpu", "cuda")
# one cheap check before the per-device ones (read before every step); torch's own, where it has it
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled",
                        lambda: any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES))


class CaptureError(TypeError):
    """torch.export could not trace the module (data-dependent control flow, unsupported Python)."""


@dataclass(frozen=True)
class InputSlot:
    """One graph input. kind: 'param' | 'buffer' | 'constant' | 'input' | 'literal'."""

    kind: str
    name: str                 # parameter / buffer FQN, constant name, or the user input's position
    leaf: int = -1            # for 'input': index into the flattened (args, kwargs) leaves
    value: Any = None         # for 'literal' (a non-tensor user input, specialized by export)
    used: bool = True         # whether any op reads it (unused params get no gradient, as in torch)
    mutated: bool = False     # whether the graph writes it back (buffers, inputs)


@dataclass(frozen=True)
class OutputSlot:
    """One graph output. kind: 'user' | 'buffer' | 'input'; target: the written FQN or leaf index."""

    kind: str
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


@functools.lru_cache(maxsize=1)
def _decompositions() -> Any:
    # building the table costs ~0.4 s per export when left to run_decompositions()
    table = torch.export.default_decompositions()
    table.update(torch_decompositions())
    return table


def autocast_state() -> tuple:
    """The autocast settings in force, per device type: part of a capture's signature."""
    if not _any_autocast():
        return ()
    return tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


def _autocast(state: tuple) -> Any:
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
    return stack


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, *, where: str = "") -> Captured:
    """Exports `module(*args, **kwargs)` and decomposes it to core ATen.

    Raises CaptureError when torch.export cannot trace the forward or decompose it, and
    UnsupportedOpError (naming the op and its module path) when the graph holds an op the registry
    cannot lower. `where` names the caller in messages (e.g. "tpudist.fit").
    """
    start = time.perf_counter()
    autocast = autocast_state()
    flat = FlatOutputs(module, context=lambda: _autocast(autocast))
    with torch.enable_grad(), warnings.catch_warnings():
        # torch.export's own deprecation noise (it deep-copies pytree specs), printed on every rank
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        try:
            # the forward enters the autocast itself: one around torch.export is not traced
            program = torch.export.export(flat, args, kwargs, strict=False)
        except Exception as exc:  # torch.export raises many types; all mean "cannot trace"
            raise CaptureError(
                f"torch -> XLA: torch.export could not trace {type(module).__name__}.forward for inputs "
                f"{_describe(args, kwargs)}: {type(exc).__name__}: {_first_line(exc)}. Data-dependent Python "
                "control flow and shapes are the usual cause; move that part outside the compiled module"
                f"{where}.") from exc
        _keep_stop_gradients(program.graph_module)
        _keep_attention(program.graph_module)
        try:
            program = program.run_decompositions(_decompositions())
        except Exception as exc:  # a decomposition of torch's own failed on this graph
            op, path = _failing_decomposition(program)
            raise CaptureError(
                f"torch -> XLA: torch's decomposition of {op} (in {path}) to core ATen failed: "
                f"{type(exc).__name__}: {_first_line(exc)}. Write that part with other torch ops, or keep it "
                f"outside the compiled module{where}.") from exc
    graph = program.graph_module.graph
    _check_ops(graph)
    template = flat.template()
    assert template is not None, "the traced forward did not run"
    captured = _plumbing(program, template)
    captured.seconds = time.perf_counter() - start
    return captured


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _failing_decomposition(program: torch.export.ExportedProgram) -> tuple[str, str]:
    """The op whose decomposition fails, found by decomposing one op kind at a time (error path only)."""
    table = _decompositions()
    seen: dict[Any, torch.fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in table:
            seen.setdefault(node.target, node)
    for op, node in seen.items():
        try:
            program.run_decompositions({op: table[op]})
        except Exception:
            return str(op), module_path(node)
    return "an op", "the forward"


def _keep_stop_gradients(gm: torch.fx.GraphModule) -> None:
    """Rewrites `detach` and `torch.no_grad()` regions to tpudist::stop_gradient (see _custom_ops)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.detach.default:
            node.target = STOP_GRADIENT
        elif node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and node.args[0] is False:
            for user in list(node.users):
                with graph.inserting_after(user):
                    stopped = graph.call_function(STOP_GRADIENT, (user,))
                stopped.meta = dict(user.meta)
                user.replace_all_uses_with(stopped, delete_user_cb=lambda n: n is not stopped)
    gm.recompile()


def _keep_attention(gm: torch.fx.GraphModule) -> None:
    """Rewrites `scaled_dot_product_attention` to tpudist::attention, which decomposition keeps."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            schema = node.target._schema.arguments
            values = {a.name: a.default_value if a.has_default_value() else None for a in schema}
            values.update(zip((a.name for a in schema), node.args))
            values.update(node.kwargs)
            node.target = ATTENTION
            node.args = (values["query"], values["key"], values["value"], values["attn_mask"],
                         float(values["dropout_p"] or 0.0), bool(values["is_causal"]), values["scale"],
                         bool(values["enable_gqa"]))
            node.kwargs = {}
    gm.recompile()


def module_path(node: torch.fx.Node) -> str:
    """Where a node comes from, e.g. "module 'encoder.0.attn' (MultiheadAttention)"."""
    stack = [(path, kind) for path, kind in (node.meta.get("nn_module_stack") or {}).values()
             if _user_path(path) is not None]
    if not stack:
        return "the top-level forward"
    path, kind = stack[-1]
    path = _user_path(path)
    kind = kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return f"module '{path}' ({kind})" if path else f"the top-level forward ({kind})"


def _user_path(path: str) -> str | None:
    """A module path under the traced wrapper (FlatOutputs) as the user's module names it; None for
    the wrapper itself."""
    if path == FlatOutputs.PREFIX[:-1]:
        return ""
    return path[len(FlatOutputs.PREFIX):] if path.startswith(FlatOutputs.PREFIX) else None


def _check_ops(graph: torch.fx.Graph) -> None:
    missing: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node.target in IGNORED_OPS:
            continue
        if lookup(node.target) is None:
            missing.setdefault(str(node.target), []).append(module_path(node))
        elif _has_symbolic_shape(node.meta.get("val")):
            raise UnsupportedOpError(
                f"torch -> XLA: {node.target} in {module_path(node)} produces a data-dependent shape "
                "(e.g. x[mask] or nonzero); XLA needs static shapes. Use torch.where or masking instead.")
    if missing:
        (op, wheres), *rest = missing.items()
        message = unsupported_message(op, wheres[0])
        if rest:
            message += f" Also unsupported in this module: {', '.join(name for name, _ in rest)}."
        raise UnsupportedOpError(message)


def _has_symbolic_shape(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_symbolic_shape(v) for v in value)
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def _plumbing(program: torch.export.ExportedProgram, template: Template) -> Captured:
    signature = program.graph_signature
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    mutated = {_strip(spec.target) if spec.kind == OutputKind.BUFFER_MUTATION else spec.target
               for spec in signature.output_specs
               if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)}
    inputs, leaf = [], 0
    for node, spec in zip(placeholders, signature.input_specs):
        used = len(node.users) > 0
        if spec.kind == InputKind.PARAMETER:
            inputs.append(InputSlot("param", _strip(spec.target), used=used))
        elif spec.kind == InputKind.BUFFER:
            name = _strip(spec.target)
            inputs.append(InputSlot("buffer", name, used=used, mutated=name in mutated))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(InputSlot("constant", spec.target, used=used))
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, torch.export.graph_signature.ConstantArgument):
                inputs.append(InputSlot("literal", spec.arg.name, leaf=leaf, value=spec.arg.value))
            else:
                inputs.append(InputSlot("input", spec.arg.name, leaf=leaf, used=used,
                                        mutated=spec.arg.name in mutated))
            leaf += 1
        else:
            raise UnsupportedOpError(f"torch -> XLA: graph input {spec.arg} of kind {spec.kind.name} "
                                     "(custom objects, tokens) is not supported")
    input_leaf = {slot.name: slot.leaf for slot in inputs if slot.kind == "input"}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    outputs = []
    for value, spec in zip(output_node.args[0], signature.output_specs):
        dtype = value.meta["val"].dtype if isinstance(value, torch.fx.Node) else None
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(OutputSlot("user", None, dtype))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(OutputSlot("buffer", _strip(spec.target), dtype))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            outputs.append(OutputSlot("input", input_leaf[spec.target], dtype))
        else:
            raise UnsupportedOpError(f"torch -> XLA: graph output of kind {spec.kind.name} is not supported")
    ops = [n for n in program.graph.nodes if n.op == "call_function"]
    counts: dict[str, int] = {}
    for n in ops:
        counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    has_random = any(is_random(n) for n in ops if n.target is not operator.getitem)
    collective = any(n.target in COLLECTIVE_OPS for n in ops)
    return Captured(graph=program.graph, inputs=inputs, outputs=outputs, template=template,
                    constants=dict(program.constants), has_random=has_random, collective=collective,
                    op_counts=counts)


def _strip(name: str) -> str:
    """A parameter or buffer name under the traced wrapper as the user's module names it."""
    return name[len(FlatOutputs.PREFIX):] if name.startswith(FlatOutputs.PREFIX) else name


def _describe(args: tuple, kwargs: dict) -> str:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return "(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                           for t in leaves) + ")"
