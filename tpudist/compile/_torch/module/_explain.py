"""`tpudist.explain(model, *inputs)`: what will compile, where it breaks and why, in one report.

Two questions, answered without compiling anything with XLA: does the whole forward capture as one
graph (what `tpudist.compile(module)` and the fused step need: torch.export and the core-ATen
decomposition, every op with a lowering), and where does dynamo cut it (what
`torch.compile(model, backend="tpudist")` would hand over: dynamo's own explain, run eagerly). The
eager run would move BatchNorm statistics and draw from the RNGs, so parameters, buffers, train/eval
modes and the global RNG states are saved before and put back after.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import random
import textwrap
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from tpudist.compile._torch.lowering._capture import capture, missing_ops
from tpudist.compile._torch.lowering._captured import CaptureError, user_path
from tpudist.compile._torch.lowering._layers import Scan, find_scans, min_layers
from tpudist.compile._torch.lowering._table import UnsupportedOpError



@dataclass
class GraphBreak:
    """One place dynamo cut the forward: its reason and the user's line ("file:line")."""

    reason: str
    where: str


@dataclass
class Explanation:
    """What `tpudist.explain` found; `str()` is the readable report, the fields are for programs.

    captured: whether the forward captures as one graph (tpudist.compile, the fused step); when not,
        capture_error says why. nodes / ops: the captured graph's op nodes and distinct ops (name -> count).
    guards: the data-dependent values the capture specialised on, each with its observed value and line.
    scans: (module list, layer count) for each run of identical layers lowered as one `lax.scan`.
    missing: every op with no lowering -> the module paths of its nodes.
    graphs / breaks: dynamo's graphs and graph breaks (`torch.compile(backend="tpudist")`); graphs is
        None when dynamo could not run, dynamo_error says why.
    """

    verdict: str = ""
    captured: bool = False
    capture_error: str | None = None
    nodes: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    parameters: int = 0
    parameter_values: int = 0
    buffers: int = 0
    guards: list[str] = field(default_factory=list)
    scans: list[tuple[str, int]] = field(default_factory=list)
    missing: dict[str, list[str]] = field(default_factory=dict)
    graphs: int | None = None
    breaks: list[GraphBreak] = field(default_factory=list)
    dynamo_error: str | None = None

    def __str__(self) -> str:
        lines = [f"tpudist.explain: {self.verdict}", "", "One graph (tpudist.compile, the fused step):"]
        if self.captured:
            lines.append(f"  captured: {self.nodes} op nodes, {len(self.ops)} distinct ops; {self.parameters} "
                         f"parameters ({self.parameter_values} values), {self.buffers} buffers")
            lines += textwrap.wrap(", ".join(f"{name} x{count}" for name, count in self.ops.items()), width=110,
                                   initial_indent="  ops: ", subsequent_indent="       ")
            lines += [f"  specialised on: {guard}" for guard in self.guards]
            lines += [f"  scan: {name}: {count} layers as one lax.scan" for name, count in self.scans]
        else:
            lines.append(f"  not captured: {self.capture_error}")
        lines += ["", f"Ops with no lowering: {len(self.missing) or 'none'}"]
        for op, wheres in self.missing.items():
            places = ", ".join(dict.fromkeys(wheres))
            lines.append(f"  {op} x{len(wheres)}: in {places}")
        lines += ["", "torch.compile(backend='tpudist') (dynamo):"]
        if self.graphs is None:
            lines.append(f"  dynamo could not run: {self.dynamo_error}")
        else:
            lines.append(f"  {self.graphs} graph(s), {len(self.breaks)} graph break(s)")
            lines += [f"  break at {b.where}: {b.reason}" for b in self.breaks]
        return "\n".join(lines)


def explain(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """Reports how `model(*args, **kwargs)` compiles (see Explanation), compiling nothing with XLA.

    Example:
        print(tpudist.explain(model, input_ids))
    """
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: its model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpudist.explain: expected a torch.nn.Module, got {type(model).__name__}")
    report = Explanation()
    with _preserved(model):
        _one_graph(report, model, args, kwargs)
    with _preserved(model):
        _dynamo(report, model, args, kwargs)
    report.verdict = _verdict(report)
    return report


def _one_graph(report: Explanation, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        captured = capture(model, args, kwargs, check_ops=False)  # (tpudist.compile's own messages)
    except (CaptureError, UnsupportedOpError) as exc:
        report.capture_error = str(exc)
        return
    report.captured = True
    calls = [n for n in captured.graph.nodes if n.op == "call_function"]
    report.nodes = sum(1 for n in calls if n.target is not operator.getitem)
    report.ops = dict(sorted((name, count) for name, count in captured.op_counts.items()
                             if name != str(operator.getitem)))
    parameters = list(model.parameters())
    report.parameters = len(parameters)
    report.parameter_values = sum(p.numel() for p in parameters)
    report.buffers = len(list(model.buffers()))
    report.guards = _guards(captured.guard)
    report.scans = [(_container(scan), len(scan.layers)) for scan in find_scans(calls, min_layers())]
    report.missing = missing_ops(captured.graph)


def _guards(guard: Any) -> list[str]:
    """Each specialised value as "what was observed (at file:line)"; a recapture follows a change."""
    if guard is None:
        return []
    found = [f"a branch on the inputs, taken as observed at capture (at {where})"
             for where in guard.where[:guard.conditions]]
    found += [f"a data-dependent length, observed {length} (at {where})"
              for length, where in zip(guard.lengths, guard.where[guard.conditions:])]
    return list(dict.fromkeys(found))  # (torch asserts one branch in several forms)


def _container(scan: Scan) -> str:
    """The module list a run of layers comes from, as the user's model names it (e.g. "transformer.h")."""
    return user_path(scan.container) or "the model"


def _dynamo(report: Explanation, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """dynamo's graphs and breaks, as `torch._dynamo.explain` finds them, without its `reset()` when
    the process holds compiled code (the reset would drop the user's compiled models); each such run
    leaves its few cache entries behind, in a region of their own."""
    import torch._dynamo
    from torch._dynamo import convert_frame
    from torch._dynamo.backends.debugging import _explain_graph_detail

    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", None)  # (torch's private tracker)
    fresh = seen is not None and not any(ref() is not None for ref in seen)
    graphs: list[torch.fx.GraphModule] = []
    reasons: list[Any] = []

    def accumulate(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        _explain_graph_detail(gm, graphs, 0, [], reasons)
        return gm.forward

    # a region of its own: the run's entries do not count against the user's recompile limit (torch >= 2.13)
    isolated = {} if fresh or "isolate_recompiles" not in inspect.signature(torch.compile).parameters \
        else {"isolate_recompiles": True}
    try:
        torch.compile(model, backend=accumulate, **isolated)(*args, **kwargs)
    except Exception as exc:  # dynamo raises many types; each means "this model does not run under dynamo"
        report.dynamo_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return
    finally:
        if fresh:
            torch._dynamo.reset()  # nothing of the user's was compiled: leave dynamo as it was
    if not graphs:
        report.dynamo_error = ("dynamo compiled no graph (the forward is skipped, or this process hit "
                               "torch._dynamo.config.accumulated_recompile_limit)")
        return
    report.graphs = len(graphs)
    for reason in reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown line"
        found = GraphBreak(" ".join(str(reason.reason).split()), where)
        if found not in report.breaks:
            report.breaks.append(found)


def _verdict(report: Explanation) -> str:
    if report.missing:
        count = len(report.missing)
        return f"cannot compile: {count} op{'s' if count > 1 else ''} ha{'ve' if count > 1 else 's'} no lowering"
    breaks = len(report.breaks)
    if report.captured:
        text = "compiles as one graph (tpudist.compile and the fused step work)"
        if report.guards:
            text += f", specialised on {len(report.guards)} data-dependent value(s)"
        if breaks:
            text += f"; torch.compile(backend='tpudist') would cut it into {report.graphs} graphs"
        return text
    if report.graphs is not None:
        return (f"needs torch.compile(backend='tpudist'): {breaks} graph break{'s' if breaks != 1 else ''} "
                "(the one-graph capture fails, see below)")
    return "cannot compile: neither the one-graph capture nor dynamo runs this forward (see below)"


@contextlib.contextmanager
def _preserved(model: torch.nn.Module) -> Iterator[None]:
    """Puts back the model's parameters, buffers and train/eval modes, and the global RNG states, as they
    were: the eager and traced runs may update BatchNorm statistics and draw random numbers."""
    tensors = [(module, kind, name, value, value.detach().clone())
               for module in model.modules() for kind in ("_parameters", "_buffers")
               for name, value in getattr(module, kind).items() if value is not None]
    modes = [(module, module.training) for module in model.modules()]
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    host = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for module, kind, name, value, saved in tensors:
                getattr(module, kind)[name] = value
                value.copy_(saved)
        for module, training in modes:
            module.training = training
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(host[0])
        np.random.set_state(host[1])
