"""`torch.compile(model, backend="tpudist")`: each graph dynamo hands over runs as a `CompiledModule`.

Dynamo has already cut the model where Python depends on data (a graph break: eager torch runs in
between) and guards each graph; a graph that fails its guards comes back here as a new graph. The
graph is an `fx.GraphModule` whose inputs include the parameters and buffers (dynamo inlines
`nn.Module`s), so wrapping it in `CompiledModule` gives inference and training on the same lowering as
`tpudist.compile(module)`: torch.export capture, forward and forward-with-VJP as XLA executables, and
gradients flowing to those inputs through torch autograd, so `.grad`s land on the model's parameters.
Registered as the `torch_dynamo_backends` entry point `tpudist` (pyproject.toml): no `import tpudist`
needed. See docs/dynamo.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from tpudist.compile._torch.lowering._layers import annotated
from tpudist.compile._torch.module._module import CompiledModule

# torch.compile's modes: they choose Inductor's tuning and CUDA graphs; XLA compiles each graph one way
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_STATE_SOURCES = ("._parameters[", "._buffers[")  # a dynamo input read from a module's parameters or buffers


@dataclass
class DynamoStats:
    """Counters of `torch.compile(..., backend="tpudist")` in this process, read with
    `tpudist.dynamo_stats()`.

    graphs: graphs dynamo handed the backend: one per piece between graph breaks, plus one per recompile
        (a failed guard: a new shape, dtype, train/eval mode, a Python value the graph specialized on).
    captures: torch.export captures of those graphs: one per graph and input signature (dynamo's dynamic
        shapes arrive as int inputs, and each new value is captured and compiled once, then cached).
    calls: calls of the compiled graphs; capture_seconds: time spent capturing.
    executables: XLA executables compiled for those captures (forward, forward-with-VJP, backward).
    Captures, calls and executables count the graphs still alive (`torch._dynamo.reset()` drops
    them); graphs counts all.
    """

    graphs: int = 0
    captures: int = 0
    calls: int = 0
    capture_seconds: float = 0.0
    executables: int = 0


_graphs = 0
_live: weakref.WeakSet[CompiledModule] = weakref.WeakSet()


def dynamo_stats() -> DynamoStats:
    """This process's `torch.compile(backend="tpudist")` counters (see DynamoStats)."""
    stats = DynamoStats(graphs=_graphs)
    for module in list(_live):
        stats.captures += module.stats.compiles
        stats.calls += module.stats.calls
        stats.capture_seconds += module.stats.capture_seconds
        stats.executables += module.stats.executables
    return stats


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
            options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The dynamo backend: `gm` (with its flat example inputs) -> a callable taking the same flat
    inputs and returning what `gm` returns, compiled on its first call.

    Example:
        compiled = torch.compile(model, backend="tpudist")
        loss = loss_fn(compiled(x), y); loss.backward(); optimizer.step()
    """
    global _graphs
    if mode is not None and mode not in MODES:
        raise ValueError(f"torch.compile(backend='tpudist'): unknown mode {mode!r}; torch's modes are {MODES}")
    if options:
        raise TypeError(f"torch.compile(backend='tpudist') takes no options; got {sorted(options)}")
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    _keep_scalars_as_tensors(gm, placeholders)
    _checkpoints_as_torch_calls(gm)
    gm.forward = annotated(gm)  # its nodes' module paths kept through export: identical layers scan
    state = frozenset(i for i, node in enumerate(placeholders) if _is_state(node))
    module = CompiledModule(gm, long_lived=state)
    _live.add(module)
    _graphs += 1
    return module.forward


def _is_state(node: torch.fx.Node) -> bool:
    """Whether dynamo reads this input from a module's parameters or buffers (then it is long-lived)."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = source.name if isinstance(getattr(source, "name", None), str) else ""
    return any(marker in name for marker in _STATE_SOURCES)


def _keep_scalars_as_tensors(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node]) -> None:
    """Dynamo passes a Python float that changes between calls (`.item()`, after a graph break) as a
    0-d float64 tensor that the graph turns back with `.item()`; the graph uses the tensor itself
    instead, so one executable serves every value (capturing the float would compile once per value)."""
    changed = False
    for node in placeholders:
        arg = node.meta.get("grapharg")
        if not getattr(arg, "pass_arg_as_tensor", False):
            continue
        for user in list(node.users):
            if user.op == "call_method" and user.target == "item" and _is_float(node):
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
                changed = True
    if changed:
        gm.recompile()


def _is_float(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _checkpoints_as_torch_calls(gm: torch.fx.GraphModule) -> None:
    """Dynamo turns `torch.utils.checkpoint` into a `tag_activation_checkpoint` node that torch.export
    cannot re-trace (torch 2.13 reads a context function dynamo sets only for selective checkpointing);
    calling `checkpoint` on the node's body is what `tpudist.compile` captures for a checkpointed model."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    nodes = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is hop]
    for node in nodes:
        node.target, node.kwargs = _checkpoint, {}
    if nodes:
        gm.recompile()


def _checkpoint(body: torch.fx.GraphModule, *args: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False)
