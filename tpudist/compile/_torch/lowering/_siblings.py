"""Tracing a run of identical layers once.

torch.export runs every layer's Python under its tracer, about 50 ms for a GPT-2 block: most of a deep
model's export. A run of identical layers (at least three consecutive children of a module list, of
one class, with the same parameter and buffer names, shapes and dtypes, and no hooks on the layers)
is traced once:

- the first layer (the template) is traced as usual, except that its first use of each input and
  parameter goes through a `tpudist::layer_mark` ("in"), and each tensor it computes and returns
  through one ("out"): the marks `_collapse` puts on a fully traced run;
- every later layer (a sibling) runs its Python with the tracer off, each torch call answered with
  what the template's gave (nothing computed: a tenth of the template's cost), and enters the graph
  as one `tpudist::layer` node reading its own inputs and parameters in the template's mark order:
  the node `_collapse` makes of a fully traced layer.

`_collapse.expand` then copies the template's decomposition for every sibling, as for a run it
collapsed itself. A sibling's Python still runs exactly once, as in a full trace, so its side
effects (a key/value cache update) happen once.

Every torch call a layer makes is logged: the function; each argument, a tensor by its role (the
layer's input k, its parameter or buffer, the output of its own call j, or an outside tensor by
identity) with its shape, stride, dtype, device and requires_grad, anything else by value; the grad
and autocast state; what the call gave. A sibling stands in only where its log, inputs and outputs
equal the template's. Anything else raises `Refused`, and the export runs again with every layer
traced: a log that differs, a layer called twice, the tracer recording while a sibling ran, a
template that writes in place to what it reads or holds a higher-order op or a checkpointed region,
and, after the export, a layer's value read outside it other than through its outputs (`check`: a
sibling's values are the template's, so one kept and read later would be the first layer's).
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode

from tpudist.compile._torch._custom_ops import LAYER, LAYER_MARK
from tpudist.compile._torch.lowering._collapse import live_nodes, writes_into
from tpudist.compile._torch.lowering._custom_grad import REMAT, in_checkpoint
from tpudist.compile._torch.lowering._layers import min_layers, module_paths

MIN_LAYERS = 3  # (as `_collapse`: with two, the one sibling saves less than the marks cost)
_refused: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


class Refused(Exception):
    """A run could not be traced once: the export runs again with every layer traced."""


def export(flat: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of `flat` (a FlatOutputs) with each run of identical layers traced
    once; where a run cannot be, again with every layer traced (that model's runs are then not
    tried again in this process)."""
    model = getattr(flat.traced, "model", flat.traced)
    standing = False
    try:
        with standing_in(flat, model) as standing:
            program = torch.export.export(flat, args, kwargs, strict=False)
        if standing:
            check(program)
        return program
    except Exception as exc:  # noqa: BLE001 - whatever failed with layers stood in is decided by a full trace
        if not standing:
            raise
        _refused[model] = f"{type(exc).__name__}: {str(exc).partition(chr(10))[0]}"
    return torch.export.export(flat, args, kwargs, strict=False)


@contextlib.contextmanager
def standing_in(root: torch.nn.Module, model: torch.nn.Module) -> Iterator[bool]:
    """While torch.export traces `root`, the later layers of each run of identical layers stand in
    as one node (see the module docstring); yields whether any run does. None is tried for `model`
    (the user's module) once one of its runs was refused in this process."""
    runs = [] if model in _refused or min_layers() == 0 or _global_hooks() else _runs(root)
    state = _State()
    patched = []
    try:
        for name, layers in runs:
            for index, module in enumerate(layers):
                patched.append((module, module.__dict__.get("forward")))
                module.forward = _Forward(state, module, name, index, module.forward)
        yield bool(runs)
    finally:
        for module, before in patched:
            if before is None:
                del module.forward
            else:
                module.forward = before


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks)


def _runs(root: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """Each run of at least MIN_LAYERS identical children of a module list (outermost first), as its
    template's path and its layers."""
    runs: list[tuple[str, list[torch.nn.Module]]] = []
    inside: list[str] = []
    for path, container in root.named_modules():
        if any(path.startswith(p) for p in inside):
            continue
        children = list(container._modules.items())
        if len(children) < MIN_LAYERS or not all(name.isdigit() for name, _ in children):
            continue
        if [int(name) for name, _ in children] != list(range(int(children[0][0]), int(children[0][0]) + len(children))):
            continue
        start = 0
        while start < len(children):
            end = start + 1
            first = _signature(children[start][1])
            while end < len(children) and first is not None and _signature(children[end][1]) == first:
                end += 1
            layers = [module for _, module in children[start:end]]
            if end - start >= MIN_LAYERS and len({id(m) for m in layers}) == len(layers):
                runs.append((f"{path}.{children[start][0]}", layers))
                inside.append(f"{path}.")
            start = end
    return runs


def _signature(module: torch.nn.Module | None) -> tuple | None:
    """What makes two layers interchangeable before they run; None for a layer never stood in."""
    if module is None:
        return None
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        hooks = (sub._forward_hooks, sub._forward_pre_hooks, sub._backward_hooks, sub._backward_pre_hooks)
        if any(not getattr(hook, "noop_while_exporting", False) for table in hooks for hook in table.values()):
            return None  # (a hook on the layer runs outside its forward: traced for every layer)
        parts.append((name, type(sub), sub.training))
    for name, value in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        parts.append((name, tuple(value.shape), value.dtype, value.requires_grad, isinstance(value, torch.nn.Parameter)))
    return tuple(parts)


@dataclass
class _Template:
    tracer: Any
    inputs: tuple  # the input's tree spec and each leaf's signature
    entries: list  # the log
    slots: list  # the role of each in-mark slot
    outputs: tuple  # the output's tree spec and each leaf's role
    spec: str  # the out-marks' shapes, strides, dtypes and devices (tpudist::layer's `spec`)
    keep: list  # every object the log names by identity, kept alive
    results: list  # per call, what it gave (as is, its tree spec, its leaves): what a later layer's call gives


class _State:
    def __init__(self) -> None:
        self.templates: dict[str, _Template] = {}
        self.called: set[int] = set()


class _Forward:
    """A layer's forward while its run may stand in."""

    def __init__(self, state: _State, module: torch.nn.Module, run: str, index: int, original: Any) -> None:
        self.state, self.module, self.run, self.index, self.original = state, module, run, index, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if id(self.module) in self.state.called:
            raise Refused(f"{self.run}: a layer of the run ran twice")
        self.state.called.add(id(self.module))
        if in_checkpoint():
            raise Refused(f"{self.run}: a layer of the run runs in a checkpointed region")
        mode = get_proxy_mode()
        if mode is None:
            raise Refused(f"{self.run}: a layer of the run ran outside torch.export's tracer")
        if self.index == 0:
            return self._template(mode, args, kwargs)
        template = self.state.templates.get(self.run)
        if template is None or template.tracer is not mode.tracer:
            raise Refused(f"{self.run}: a later layer ran before the first, or in another graph")
        return self._sibling(mode, template, args, kwargs)

    def _roles(self, leaves: list) -> dict[int, tuple]:
        roles: dict[int, tuple] = {}
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                roles.setdefault(id(leaf), ("in", k))
        for name, value in (*self.module.named_parameters(remove_duplicate=False),
                            *self.module.named_buffers(remove_duplicate=False)):
            roles.setdefault(id(value), ("param", name))
        return roles

    def _template(self, mode: Any, args: tuple, kwargs: dict) -> Any:
        graph = mode.tracer.graph
        tail = next(iter(reversed(graph.nodes)), None)
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        log = _Log(self._roles(leaves), self.run)
        inputs = (in_spec, [log.sig(leaf) for leaf in leaves])
        with log:
            out = self.original(*args, **kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        slots_out: dict[int, int] = {}
        marks_out: list[torch.Tensor] = []
        roles, given = [], []
        for leaf in out_leaves:
            role = log.sig(leaf)
            if isinstance(leaf, torch.Tensor) and role[0][0] == "op":
                if id(leaf) not in slots_out:
                    slots_out[id(leaf)] = len(marks_out)
                    marks_out.append(LAYER_MARK(leaf, self.run, "out", len(marks_out)))
                leaf = marks_out[slots_out[id(leaf)]]
            roles.append(role)
            given.append(leaf)
        nodes = _after(graph, tail)
        inside = set(nodes)
        reads = {v for n in nodes for v in n.all_input_nodes if v not in inside}
        if any(REMAT in (n.meta.get("custom") or {}) for n in nodes) or writes_into(nodes, reads, opaque=True):
            raise Refused(f"{self.run}: the first layer writes in place to what it reads, holds a higher-order op "
                          "or lies in a checkpointed region")
        spec = repr([(tuple(m.shape), tuple(m.stride()), str(m.dtype).removeprefix("torch."), str(m.device))
                     for m in marks_out])
        self.state.templates[self.run] = _Template(mode.tracer, inputs, log.entries, log.slots, (out_spec, roles),
                                                   spec, log.keep, log.results)
        return pytree.tree_unflatten(given, out_spec)

    def _sibling(self, mode: Any, template: _Template, args: tuple, kwargs: dict) -> Any:
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        roles = self._roles(leaves)
        log = _Log(roles, None, keep=template.keep, template=template,
                   own={role: value for value, role in _owned(self.module, leaves, roles)})
        if (in_spec, [log.sig(leaf) for leaf in leaves]) != template.inputs:
            raise Refused(f"{self.run}: layer {self.index} is called with other inputs than the first")
        graph = mode.tracer.graph
        count = len(graph.nodes)
        with disable_proxy_modes_tracing(), log:
            out = self.original(*args, **kwargs)
        if len(graph.nodes) != count:
            raise Refused(f"{self.run}: layer {self.index} recorded graph nodes with the tracer off")
        if len(log.entries) != len(template.entries):
            raise Refused(f"{self.run}: layer {self.index} runs other torch calls than the first")
        out_leaves, out_spec = pytree.tree_flatten(out)
        if (out_spec, [log.sig(leaf) for leaf in out_leaves]) != template.outputs:
            raise Refused(f"{self.run}: layer {self.index} gives other outputs than the first")
        results = LAYER(self.run, self.index, template.spec, [log.own[role] for role in template.slots])
        given, slot = [], {}
        for leaf in out_leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) in log.produced:
                leaf = results[slot.setdefault(id(leaf), len(slot))]
            given.append(leaf)
        return pytree.tree_unflatten(given, out_spec)


def _owned(module: torch.nn.Module, leaves: list, roles: dict[int, tuple]) -> Iterator[tuple[torch.Tensor, tuple]]:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            yield leaf, roles[id(leaf)]
    for _, value in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        yield value, roles[id(value)]


def _after(graph: torch.fx.Graph, tail: torch.fx.Node | None) -> list[torch.fx.Node]:
    nodes = list(graph.nodes)
    start = nodes.index(tail) + 1 if tail is not None else 0
    return [n for n in nodes[start:] if n.op == "call_function" and n.target is not LAYER_MARK]


class _Log(torch.overrides.TorchFunctionMode):
    """Logs every torch call a layer's Python makes (see the module docstring). A template's (`run`
    given) first use of each input and parameter goes through an in-mark. A sibling's (`template`
    given; `own`: its inputs and parameters by role) call is compared with the template's and, not
    run, gives what the template's gave, with the sibling's own inputs and parameters in place."""

    def __init__(self, roles: dict[int, tuple], run: str | None, keep: list | None = None,
                 template: "_Template | None" = None, own: dict[tuple, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.roles, self.run, self.template, self.own = roles, run, template, own or {}
        self.keep = keep if keep is not None else []
        self.entries: list[tuple] = []
        self.results: list[tuple] = []
        self.slots: list[tuple] = []
        self.marks: dict[tuple, torch.Tensor] = {}
        self.produced: set[int] = set()
        self.alive: list[Any] = []  # every tensor the log gave a role, so that no id is reused while it runs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        with torch._C.DisableTorchFunction():  # (reading metadata through the tracer's own modes costs 10x)
            state = _global_state()
            sig = [self.sig(leaf) for leaf in leaves]
        j = len(self.entries)
        if self.template is not None:
            return self._replay(j, (func, spec, tuple(sig), state))
        if self.run is not None:
            leaves = [self._mark(leaf, role) for leaf, role in zip(leaves, sig)]
            args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = func(*args, **kwargs)
        given, out_spec = pytree.tree_flatten(out)
        with torch._C.DisableTorchFunction():
            self._produced(j, given)
            self.entries.append((func, spec, tuple(sig), state, tuple(self.sig(v) for v in given)))
        self.results.append((out, out_spec, given))
        return out

    def _replay(self, j: int, call: tuple) -> Any:
        entries = self.template.entries
        if j >= len(entries) or entries[j][:4] != call:
            raise Refused(f"{call[0]}: a later layer makes another torch call than the first")
        out, out_spec, leaves = self.template.results[j]
        given = [self.own[sig[0]] if isinstance(leaf, torch.Tensor) and sig[0][0] in ("in", "param") else leaf
                 for leaf, sig in zip(leaves, entries[j][4])]
        self._produced(j, given)
        self.entries.append(entries[j])
        if all(a is b for a, b in zip(given, leaves)):
            return out  # (as it was: a torch.Size stays one)
        return pytree.tree_unflatten(given, out_spec)

    def _produced(self, j: int, given: list) -> None:
        for m, value in enumerate(given):
            if isinstance(value, torch.Tensor) and id(value) not in self.roles:
                self.roles[id(value)] = ("op", j, m)
                self.produced.add(id(value))
                self.alive.append(value)

    def _mark(self, leaf: Any, sig: tuple) -> Any:
        role = sig[0]
        if not isinstance(leaf, torch.Tensor) or role[0] not in ("in", "param"):
            return leaf
        if role not in self.marks:
            mark = LAYER_MARK(leaf, self.run, "in", len(self.slots))
            self.slots.append(role)
            self.marks[role] = mark
            self.roles[id(mark)] = role
            self.alive.append(mark)
        return self.marks[role]

    def sig(self, value: Any) -> tuple:
        if isinstance(value, torch.Tensor):
            role = self.roles.get(id(value))
            if role is None:
                role = ("outside", id(value))
                self.keep.append(value)
            if value.layout != torch.strided or any(
                    type(s) is not int for s in (*value.shape, *value.stride(), value.storage_offset())):
                raise Refused("a layer computes with a tensor of symbolic shape or sparse layout")
            return (role, tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device,
                    value.requires_grad)
        return _value(value, self.keep)


def _global_state() -> tuple:
    """What else decides the ops a torch call records."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


_PLAIN = (bool, int, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _value(value: Any, keep: list) -> tuple:
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind is float:
        return (kind, repr(value))  # (tells -0.0 from 0.0, and NaN equals itself)
    if kind is torch.Size:
        return (kind, tuple(value))
    if kind is slice:
        return (kind, _value(value.start, keep), _value(value.stop, keep), _value(value.step, keep))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise Refused("a layer computes with a symbolic size")
    keep.append(value)
    return ("object", id(value))


def check(program: torch.export.ExportedProgram) -> None:
    """Raises Refused where the exported program shows that a run could not stand in: a sibling's value
    read after it (a fake constant), or the template's value read other than through its outputs."""
    gm = program.graph_module
    for name, value in program.constants.items():
        if isinstance(value, FakeTensor):
            raise Refused(f"a value a stood-in layer computed is read after it ({name})")
    names = {n.args[0] for n in gm.graph.nodes if n.target is LAYER}
    for name in names:
        region = {n for n in gm.graph.nodes if n.op == "call_function" and n.target is not LAYER_MARK
                  and any(p == name or p.startswith(name + ".") for p in module_paths(n))}
        for node in region:  # (a later layer's Python holds the first layer's values: see `_Log`)
            if any(user not in region and not (user.target is LAYER_MARK and user.args[2] == "out")
                   for user in node.users):
                raise Refused(f"{name}: a value the first layer computed is read after it")
    live = live_nodes(gm.graph)
    if any(n.target is LAYER_MARK and n.args[2] == "out" and n not in live for n in gm.graph.nodes):
        raise Refused("an output of a first layer is read by nothing")  # (the decomposition would drop it)
    outs = {n for n in gm.graph.nodes if (n.target is LAYER_MARK and n.args[2] == "out")
            or (n.target is operator.getitem and getattr(n.args[0], "target", None) is LAYER)}
    if outs and writes_into([n for n in gm.graph.nodes if n.op == "call_function"], outs, opaque=False):
        raise Refused("an output of a stood-in layer is written in place after it")
