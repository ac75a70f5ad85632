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
import io
import operator
import random
import re
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch

from tpudist.compile._torch.lowering._shape_checks import check_shapes
from tpudist.compile._torch.lowering import _capture_cache, _collapse, _custom_grad, _custom_vjp, _observed, _siblings
from tpudist.compile._torch._custom_ops import ATTENTION, STOP_GRADIENT
from tpudist.compile._torch.lowering._repeated_heads import erase_unused, unrepeated
from tpudist.compile._torch.lowering._captured import CaptureError, Captured, module_path, plumbing
from tpudist.compile._torch.lowering._outputs import FlatOutputs
from tpudist.compile._torch.lowering._layers import min_layers
from tpudist.compile._torch.lowering._decompose import decompose, decompositions as _decompositions
from tpudist.compile._torch.lowering._experts import check_experts, experts_as_one_op
from tpudist.compile._torch.lowering.ops.ctc import CtcAsOneOp
from tpudist.compile._torch.lowering._registry import (
    IGNORED_OPS,
    UnsupportedOpError,
    lookup,
    unsupported_message,
)

AUTOCAST_DEVICES = ("cpu", "cuda")
# one cheap check before the per-device ones (read before every step); torch's own, where it has it
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled",
                        lambda: any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES))


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


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, *, where: str = "",
            torch_autograd: bool = True, check_ops: bool = True, experts: bool = False,
            cache: bool = False) -> Captured:
    """Exports `module(*args, **kwargs)` and decomposes it to core ATen (`_capture` says how).
    torch.export runs without recording each node's Python stack (time spent on every node); a
    capture that fails runs again with them, so that its error names the user's line."""
    options = dict(where=where, torch_autograd=torch_autograd, check_ops=check_ops, experts=experts, cache=cache)
    try:
        return _capture(module, args, kwargs, traces=False, **options)
    except CaptureError:  # (an UnsupportedOpError names the op's module path, which needs no stack)
        pass
    return _capture(module, args, kwargs, traces=True, **options)


def _capture(module: torch.nn.Module, args: tuple, kwargs: dict, *, where: str, torch_autograd: bool,
             check_ops: bool, experts: bool, cache: bool, traces: bool) -> Captured:
    """Exports `module(*args, **kwargs)` and decomposes it to core ATen.

    `torch_autograd=False` (the fused step) means torch's autograd engine never runs for this
    graph, so gradient hooks on parameters, which only it calls, are an error.

    Raises CaptureError when torch.export cannot trace the forward or decompose it, and
    UnsupportedOpError (naming the op and its module path) when the graph holds an op the registry
    cannot lower. `where` names the caller in messages (e.g. "tpudist.fit"). `check_ops=False`
    (tpudist.explain) returns the graph even when ops have no lowering, to list them all.
    `experts=True` (expert parallelism) captures `transformers`' experts modules as one op each.
    `cache=True` (the fused step) looks the exported graph up in the step cache (`_capture_cache`):
    on a hit the graph stays undecomposed until something lowers it (`Captured.complete`).
    """
    start = time.perf_counter()
    autocast = autocast_state()
    flat = FlatOutputs(module, context=lambda: _autocast(autocast))
    _check_layouts(module, args, kwargs, where)
    try:
        _custom_grad.check_backward_hooks(module)
        if not torch_autograd:  # (the fused step captures its objective, which holds the user's model)
            _custom_grad.check_parameter_hooks(getattr(module, "model", module))
    except _custom_grad.CustomGradError as exc:
        raise _custom_grad_error(exc, where) from None
    if experts:
        check_experts(module, where)
    with torch.enable_grad(), warnings.catch_warnings(), _custom_grad.intercepted():
        # torch.export's own deprecation noise (it deep-copies pytree specs), printed on every rank
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        try:
            # the forward enters the autocast itself: one around torch.export is not traced
            # (preserve_node_meta keeps checkpoint marks: _custom_grad)
            with torch.fx.traceback.preserve_node_meta(), CtcAsOneOp(), \
                    experts_as_one_op(module) if experts else contextlib.nullcontext():
                before = _host_random_state()
                program, guard = _export(flat, args, kwargs, traces)
                if _host_random_state() != before:
                    raise CaptureError(
                        f"torch -> XLA: {type(module).__name__}.forward draws random numbers with Python's `random` "
                        "or numpy's global generator while it is traced (e.g. transformers' SpecAugment masks, "
                        "mask_time_prob > 0); the compiled graph would replay the traced draw on every call. Draw "
                        f"them with torch (torch.rand / torch.bernoulli), or turn that option off{where}.")
        except _custom_grad.CustomGradError as exc:
            raise _custom_grad_error(exc, where) from None
        except (CaptureError, UnsupportedOpError):
            raise  # a custom Function's own capture, or an output tpudist cannot return: already explained
        except Exception as exc:  # torch.export raises many types; all mean "cannot trace"
            raise CaptureError(
                f"torch -> XLA: torch.export could not trace {type(module).__name__}.forward for inputs "
                f"{_describe(args, kwargs)}: {type(exc).__name__}: {_first_line(exc)}{_raised_at(exc)}. "
                "Data-dependent Python control flow and shapes are the usual cause; move that part outside the "
                f"compiled module{where}.") from exc
        _keep_stop_gradients(program.graph_module)
        _keep_attention(program.graph_module)
        check_shapes(program.graph_module.graph)  # what torch's kernels refuse and its meta kernels let through
        template = flat.template()
        assert template is not None, "the traced forward did not run"
        key = _capture_cache.key_of(program, (autocast, experts, check_ops, torch_autograd, min_layers())) \
            if cache and guard is None else None
        entry = _capture_cache.load("capture", key) if key is not None else None
        if entry is not None:
            captured = Captured.from_entry(entry, program, template, key, lambda: _decomposed(
                program, template, guard, where, check_ops, start))
            captured.seconds = time.perf_counter() - start
            return captured
        captured = _decomposed(program, template, guard, where, check_ops, start)
    if key is not None:
        _capture_cache.store_capture(key, captured, program)
    return captured


def _decomposed(program: torch.export.ExportedProgram, template: Any, guard: Any, where: str, check_ops: bool,
                start: float) -> Captured:
    """The rest of a capture after torch.export: the decomposition to core ATen and its checks."""
    runs = _collapse.collapse(program.graph_module) if guard is None else []  # identical layers: decomposed once
    program.graph_module.recompile()  # the rewrites above changed its graph (a step cache hit never needs it)
    with torch.enable_grad(), warnings.catch_warnings(), _custom_grad.intercepted():
        try:
            with _observed.quiet() if guard is not None else contextlib.nullcontext():
                program = decompose(program, _decompositions())
        except Exception as exc:  # a decomposition of torch's own failed on this graph
            op, path = _failing_decomposition(program)
            raise CaptureError(
                f"torch -> XLA: torch's decomposition of {op} (in {path}) to core ATen failed: "
                f"{type(exc).__name__}: {_first_line(exc)}. Write that part with other torch ops, or keep it "
                f"outside the compiled module{where}.") from exc
    _collapse.expand(program.graph_module, runs)
    program = _without_effect_tokens(program)
    graph = program.graph_module.graph
    _check_ops(graph, check_ops)
    _prepare_functions(graph, where)
    captured = plumbing(program, template)
    captured.guard = guard
    captured.seconds = time.perf_counter() - start
    return captured


def _host_random_state() -> tuple:
    """Python's and numpy's global generators, to tell whether a trace drew from them (a draw torch.export
    cannot see: it would be baked into the graph as a constant)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return random.getstate(), keys.tobytes(), pos, has_gauss, cached


def _export(flat: torch.nn.Module, args: tuple, kwargs: dict,
            traces: bool) -> tuple[torch.export.ExportedProgram, Any]:
    """torch.export (`traces`: recording each node's stack); where it stops at a value computed from
    the inputs, again with the real values deciding (specialised and guarded, see _observed)."""
    printed = io.StringIO()  # torch prints the partial graph of a failed export; not when recovered here
    program = None
    try:
        with contextlib.redirect_stderr(printed), _observed.quiet(), \
                contextlib.nullcontext() if traces else _without_stack_traces():
            program = _siblings.export(flat, args, kwargs)  # (a run of identical layers traced once)
    except Exception as exc:
        if not _observed.is_data_dependent(exc):
            raise
        printed = io.StringIO()
    finally:
        sys.stderr.write(printed.getvalue())
    name = f"{type(flat.traced).__name__}.forward"
    if program is None:
        return _observed.export_observed(flat, args, kwargs, name)
    if not _observed.has_data_dependent_length(program):
        return program, None
    try:  # x[mask] on inputs: specialised on the mask's count and guarded
        return _observed.export_observed(flat, args, kwargs, name, program)
    except CaptureError:
        raise
    except Exception:  # noqa: BLE001 - torch could not trace it so: _check_ops names the op and the rewrite
        return program, None


@contextlib.contextmanager
def _without_stack_traces() -> Any:
    config = torch.fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _check_layouts(module: torch.nn.Module, args: tuple, kwargs: dict, where: str) -> None:
    """Sparse and other non-strided tensors are refused before torch.export sees them (its fake
    tensors abort the process on some sparse layouts)."""
    named = [(f"input {i}", t) for i, t in enumerate(torch.utils._pytree.tree_leaves((args, kwargs)))]
    named += [(f"'{n}'", t) for n, t in (*module.named_parameters(), *module.named_buffers())]
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise CaptureError(f"torch -> XLA: {name} is a tensor of layout {value.layout}; XLA computes on dense "
                               f"arrays. Pass it as .to_dense(){where}.")


def _without_effect_tokens(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """torch.linalg's checked functions (inv, solve, cholesky, lu_factor) thread an effect token
    through `aten._linalg_check_errors` (a `with_effects` node); unthreaded it is a plain op, lowered
    as a no-op (a running XLA program cannot raise: a singular matrix gives inf/NaN, see docs)."""
    if not any(n.target is torch.ops.higher_order.with_effects for n in program.graph.nodes):
        return program
    from torch.export._remove_effect_tokens_pass import _remove_effect_tokens  # torch's own pass (private)
    return _remove_effect_tokens(program)


def _custom_grad_error(exc: Exception, where: str) -> CaptureError:
    text = str(exc)
    # a message about a custom Function already names it; `where` would name it again
    return CaptureError(f"torch -> XLA: {text}{'' if text.startswith('custom autograd.Function') else where}.")


def _prepare_functions(graph: torch.fx.Graph, where: str) -> None:
    from tpudist.compile._torch.lowering._lower import lower  # (late: _lower imports this module)
    try:
        _custom_vjp.prepare(graph, capture, lower)
    except _custom_grad.CustomGradError as exc:
        raise _custom_grad_error(exc, where) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _raised_at(exc: BaseException) -> str:
    """ " (at file:line)": the user's call torch.export names in its message, if it does."""
    text = str(exc)
    if "The following call raised this error" not in text:
        return ""
    found = re.search(r'File "([^"]+)", line (\d+)', text.split("The following call raised this error", 1)[1])
    return f" (at {found.group(1)}:{found.group(2)})" if found else ""


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
    """Rewrites `detach` and `torch.no_grad()` regions to tpudist::stop_gradient (see _custom_ops),
    in the graph only: `_decomposed` recompiles the module's code."""
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


def _keep_attention(gm: torch.fx.GraphModule) -> None:
    """Rewrites `scaled_dot_product_attention` to tpudist::attention, which decomposition keeps (in
    the graph only, as `_keep_stop_gradients`)."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            schema = node.target._schema.arguments
            values = {a.name: a.default_value if a.has_default_value() else None for a in schema}
            values.update(zip((a.name for a in schema), node.args))
            values.update(node.kwargs)
            key, value, gqa = values["key"], values["value"], bool(values["enable_gqa"])
            shared = unrepeated(key), unrepeated(value)
            repeated = ()
            if shared[0] is not None and shared[1] is not None and shared[0][1] == shared[1][1]:
                repeated = (key, value)
                (key, _), (value, _) = shared  # transformers' repeat_kv before attention: the heads as they are
                gqa = True
            node.target = ATTENTION
            node.args = (values["query"], key, value, values["attn_mask"],
                         float(values["dropout_p"] or 0.0), bool(values["is_causal"]), values["scale"], gqa)
            node.kwargs = {}
            for dropped in repeated:
                erase_unused(gm.graph, dropped)


# static-shape rewrites for ops whose output shape depends on values
_STATIC_REWRITES = {
    "nonzero": "torch.nonzero_static(x, size=K) (padded to a fixed K), or keep the mask and use torch.where",
    "argwhere": "torch.nonzero_static(x, size=K) (padded to a fixed K), or keep the mask and use torch.where",
    "masked_select": "torch.where(mask, x, 0) (or x * mask), which keeps x's shape",
    "index": "torch.where(mask, x, 0) instead of x[mask], which keeps x's shape",
    "unique": "a fixed-size result: F.one_hot(x, K).sum(0) (counts over a known range K), or x.sort() and a "
              "mask of first occurrences",
    "bincount": "F.one_hot(ids, n).sum(0) or torch.zeros(n).index_add_(0, ids, weights) for a known length n",
    "repeat_interleave": "repeats as a Python int or list, or output_size=",
}


def _check_ops(graph: torch.fx.Graph, check_ops: bool = True) -> None:
    for node in _op_nodes(graph):
        if _has_symbolic_shape(node.meta.get("val")):
            # the first node whose shape depends on values is where the data-dependence starts
            raise CaptureError(_data_dependent_message(node))
    missing = missing_ops(graph) if check_ops else {}
    if missing:
        (op, wheres), *rest = missing.items()
        message = unsupported_message(op, wheres[0])
        if rest:
            message += f" Also unsupported in this module: {', '.join(name for name, _ in rest)}."
        raise UnsupportedOpError(message)


def missing_ops(graph: torch.fx.Graph) -> dict[str, list[str]]:
    """Every op in `graph` with no lowering -> the module path of each of its nodes, in graph order."""
    missing: dict[str, list[str]] = {}
    for node in _op_nodes(graph):
        if lookup(node.target) is None:
            missing.setdefault(str(node.target), []).append(module_path(node))
    return missing


def _op_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [node for node in graph.nodes
            if node.op == "call_function" and node.target is not operator.getitem and node.target not in IGNORED_OPS]


def _data_dependent_message(node: torch.fx.Node) -> str:
    name = str(node.target).split(".")[1]
    hint = next((text for key, text in _STATIC_REWRITES.items() if name.lstrip("_").startswith(key)),
                "a static-shape form of that computation (torch.where, a mask)")
    return (f"torch -> XLA: {node.target} in {module_path(node)} produces a data-dependent shape; XLA compiles "
            f"for static shapes. Use {hint}, or keep that part outside the compiled module (the op is at "
            f"{_observed.user_line(node)}).")


def _has_symbolic_shape(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_symbolic_shape(v) for v in value)
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def _describe(args: tuple, kwargs: dict) -> str:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return "(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                           for t in leaves) + ")"
