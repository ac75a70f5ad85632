"""Capture: a torch.nn.Module and example inputs -> a core-ATen graph plus how to feed it.

`torch.export` (non-strict) traces the module's forward for one input signature into an ATen
graph whose inputs are the module's parameters, buffers, lifted constants and the user's inputs,
and whose outputs are the buffer updates (BatchNorm running statistics) and the user's outputs.
Decomposing it to core ATen leaves ~200 op overloads to lower, all listed in one registry.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_flatten

from tpudist.compile._torch._custom_ops import COLLECTIVE_OPS, STOP_GRADIENT
from tpudist.compile._torch._registry import IGNORED_OPS, UnsupportedOpError, lookup, unsupported_message


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
    out_spec: Any             # pytree spec of the user outputs
    constants: dict[str, torch.Tensor]
    has_random: bool
    collective: bool = False  # holds ops that reach other processes (ShardedEmbedding's lookup)
    seconds: float = 0.0
    op_counts: dict[str, int] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _decompositions() -> dict[Any, Any]:
    # building the table costs ~0.4 s per export when left to run_decompositions()
    return torch.export.default_decompositions()


def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Exports `module(*args, **kwargs)` and decomposes it to core ATen.

    Raises CaptureError when torch.export cannot trace the forward, and UnsupportedOpError
    (naming the op and its module path) when the graph holds an op the registry cannot lower.
    """
    start = time.perf_counter()
    with torch.enable_grad(), warnings.catch_warnings():
        # torch.export's own deprecation noise (it deep-copies pytree specs), printed on every rank
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        attention = _portable_attention(module, args, kwargs)
        try:
            with attention():
                program = torch.export.export(module, args, kwargs, strict=False)
        except Exception as exc:  # torch.export raises many types; all mean "cannot trace"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CaptureError(
                f"torch -> XLA: torch.export could not trace {type(module).__name__}.forward for inputs "
                f"{_describe(args, kwargs)}: {type(exc).__name__}: {first}. Data-dependent Python control "
                "flow and shapes are the usual cause; move that part outside the compiled module.") from exc
        _keep_stop_gradients(program.graph_module)
        with attention():  # attention is decomposed here, by the kernel choice in force
            program = program.run_decompositions(_decompositions())
    graph = program.graph_module.graph
    _check_ops(graph)
    captured = _plumbing(program)
    captured.seconds = time.perf_counter() - start
    return captured


def _portable_attention(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """A context factory for capturing `module`: on a GPU, torch.nn.attention.sdpa_kernel(MATH).

    On a GPU, scaled_dot_product_attention traces to a fused CUDA kernel (efficient / flash /
    cuDNN attention) that has no decomposition; its math form decomposes to ops XLA lowers (and
    XLA fuses them itself). CPU graphs keep torch's own CPU decomposition."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tensors.append(next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)))
    if all(t.device.type == "cpu" for t in tensors):
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return lambda: sdpa_kernel([SDPBackend.MATH])


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


def module_path(node: torch.fx.Node) -> str:
    """Where a node comes from, e.g. "module 'encoder.0.attn' (MultiheadAttention)"."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the top-level forward"
    path, kind = list(stack.values())[-1]
    kind = kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return f"module '{path}' ({kind})" if path else f"the top-level forward ({kind})"


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


def _plumbing(program: torch.export.ExportedProgram) -> Captured:
    signature = program.graph_signature
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    mutated = {spec.target for spec in signature.output_specs
               if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)}
    inputs, leaf = [], 0
    for node, spec in zip(placeholders, signature.input_specs):
        used = len(node.users) > 0
        if spec.kind == InputKind.PARAMETER:
            inputs.append(InputSlot("param", spec.target, used=used))
        elif spec.kind == InputKind.BUFFER:
            inputs.append(InputSlot("buffer", spec.target, used=used, mutated=spec.target in mutated))
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
            outputs.append(OutputSlot("buffer", spec.target, dtype))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            outputs.append(OutputSlot("input", input_leaf[spec.target], dtype))
        else:
            raise UnsupportedOpError(f"torch -> XLA: graph output of kind {spec.kind.name} is not supported")
    ops = [n for n in program.graph.nodes if n.op == "call_function"]
    counts: dict[str, int] = {}
    for n in ops:
        counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    has_random = any(getattr(lookup(n.target), "random", False) for n in ops if n.target is not operator.getitem)
    collective = any(n.target in COLLECTIVE_OPS for n in ops)
    return Captured(graph=program.graph, inputs=inputs, outputs=outputs, out_spec=program.call_spec.out_spec,
                    constants=dict(program.constants), has_random=has_random, collective=collective,
                    op_counts=counts)


def _describe(args: tuple, kwargs: dict) -> str:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return "(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                           for t in leaves) + ")"
