"""Gradients the capture cannot read off the forward: custom `autograd.Function`s and checkpoints.

The backward of a compiled module is JAX's autodiff of the captured forward. That is torch's
gradient for every ATen op, but not for code that defines its own:

- A custom `torch.autograd.Function` has a `backward` of its own (a straight-through estimator, a
  gradient reversal, a hand-fused kernel). While capturing, `Function.apply` becomes one graph node
  (`tpudist::autograd_function`); its `forward` and its `backward` are each captured on their own,
  and the node is lowered to a `jax.custom_vjp` whose backward is the lowered `backward`, fed with
  what `forward` saved (`ctx.save_for_backward`, tensors set on ctx) and its static attributes.
- `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=True)` is such a Function whose forward
  runs under `no_grad`: captured as is, it has no gradient. It is captured as the plain call of `fn`
  (its true gradient), with the nodes marked as one rematerialized region (`REMAT`); the
  non-reentrant form is marked the same way. The lowering recomputes the region in the backward
  (`jax.checkpoint`), as torch does.
- Hooks on tensors (`Tensor.register_hook` inside forward) and module backward hooks change
  gradients in ways the graph does not hold: capturing either is a CaptureError naming it.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as checkpoint_module

REMAT = "tpudist_remat"  # node.meta["custom"] key: the id of the checkpointed region the node belongs to
_region_ids = itertools.count(1)
_call_ids = itertools.count(1)
_CALLS: dict[int, "FunctionCall"] = {}  # every call recorded while capturing, by id (read by _custom_vjp)
_active = threading.local()


class CustomGradError(RuntimeError):
    """A construct whose gradient the capture cannot keep (raised as the capture's CaptureError)."""


@torch.library.custom_op("tpudist::autograd_function", mutates_args=())
def autograd_function(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One `Function.apply(...)` call: its tensor arguments in, its outputs out (`call` indexes the
    recorded call, see FunctionCall). Only captured, never run by torch."""
    raise RuntimeError("tpudist::autograd_function runs only inside a compiled graph")


@autograd_function.register_fake
def _autograd_function_fake(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return _CALLS[call].fake_forward(tensors)


AUTOGRAD_FUNCTION = torch.ops.tpudist.autograd_function.default


class _Ctx:
    """The `ctx` a custom Function's forward and backward see, outside torch's autograd engine."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors

    @property
    def saved_tensors(self) -> tuple:
        return self.to_save

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass  # their cotangents are zeros, which is what backward receives in torch too

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value  # cotangents are always materialized (zeros) here

    def mark_dirty(self, *tensors: Any) -> None:
        raise CustomGradError("marks an input dirty (modifies it in place); tpudist cannot keep an in-place "
                              "custom Function. Return a new tensor instead")


_CTX_OWN = frozenset(vars(_Ctx(())).keys())


@dataclass
class FunctionCall:
    """One `Function.apply` met while capturing: the class, the non-tensor arguments, and after the
    call's forward was run on fake tensors, the ctx's static attributes."""

    cls: type
    layout: list[Any]                      # per positional argument: None for a tensor, else (value,)
    needs_input_grad: tuple[bool, ...]
    single: bool = True                    # forward returned one tensor (else a tuple)
    # filled in by _custom_vjp when the call's forward and backward are captured:
    statics: dict[str, Any] = field(default_factory=dict)     # non-tensor attributes forward set on ctx
    saved_statics: list[Any] = field(default_factory=list)    # save_for_backward's arguments: None for a tensor
    saved: list[bool] = field(default_factory=list)
    tensor_attrs: list[str] = field(default_factory=list)      # tensors forward set on ctx, by name
    output_dtypes: list[torch.dtype] = field(default_factory=list)
    grad_positions: list[int] = field(default_factory=list)    # tensor arguments backward gives a gradient
    forward_fn: Callable[..., Any] | None = None
    backward_fn: Callable[..., Any] | None = None
    random: bool = False

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def arguments(self, tensors: list[Any]) -> list[Any]:
        it = iter(tensors)
        return [next(it) if slot is None else slot[0] for slot in self.layout]

    def run_forward(self, ctx: _Ctx, tensors: list[Any]) -> tuple:
        args = self.arguments(tensors)
        if _setup_context_defined(self.cls):
            output = self.cls.forward(*args)
            self.cls.setup_context(ctx, tuple(args), output)
        else:
            output = self.cls.forward(ctx, *args)
        self.single = not isinstance(output, tuple)
        outputs = (output,) if self.single else output
        for value in outputs:
            if not isinstance(value, torch.Tensor):
                raise CustomGradError(f"returns a {type(value).__name__} among its outputs; tpudist supports "
                                      "custom Functions whose forward returns tensors")
        return outputs

    def fake_forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            outputs = self.run_forward(_Ctx(self.needs_input_grad), tensors)
        return [t.clone() for t in outputs]  # a custom op's outputs may not alias its inputs


def _setup_context_defined(cls: type) -> bool:
    from torch.autograd.function import _SingleLevelFunction
    return getattr(cls, "setup_context", None) is not _SingleLevelFunction.setup_context


def _checkpoint_function() -> type:
    return checkpoint_module.CheckpointFunction


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """`Function.apply` while capturing (see the module docstring)."""
    if cls is _checkpoint_function():
        function, _preserve_rng, *inputs = args
        return _reentrant_checkpoint(function, inputs)
    if kwargs:
        if not _setup_context_defined(cls):
            raise _error(cls, "was called with keyword arguments, which torch accepts only for Functions with "
                              "setup_context")
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
    for value in args:
        if isinstance(value, (list, tuple, dict)) and any(
                isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(value)):
            raise _error(cls, "takes tensors inside a list, tuple or dict; pass them as separate arguments")
    call = FunctionCall(cls, [None if isinstance(a, torch.Tensor) else (a,) for a in args],
                        tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
    key = next(_call_ids)
    _CALLS[key] = call
    try:
        outputs = AUTOGRAD_FUNCTION(key, [a for a in args if isinstance(a, torch.Tensor)])
    except CustomGradError as exc:
        raise _error(cls, str(exc)) from None
    return outputs[0] if call.single else tuple(outputs)


def _error(cls: type, what: str) -> CustomGradError:
    return CustomGradError(f"custom autograd.Function {cls.__module__}.{cls.__qualname__} {what}")


def _reentrant_checkpoint(function: Callable[..., Any], inputs: list[Any]) -> Any:
    if torch.is_grad_enabled() and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        # torch's reentrant checkpoint gives no gradient at all when no input requires one (it warns
        # "None of the inputs have requires_grad=True"): the same, exactly
        with torch.no_grad():
            return function(*inputs)
    with _region():
        return function(*inputs)


@contextlib.contextmanager
def _region() -> Iterator[None]:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        with torch.fx.traceback.annotate({REMAT: next(_region_ids)}):
            yield
    finally:
        _inside.depth -= 1


def in_checkpoint() -> bool:
    """Whether the capture is inside a checkpointed region now."""
    return getattr(_inside, "depth", 0) > 0


_inside = threading.local()


def _non_reentrant(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
    # stands in for torch.utils.checkpoint._checkpoint_without_reentrant_generator: checkpoint()
    # runs the function between its two next() calls, here inside one marked region
    with _region():
        yield


def _register_hook(tensor: torch.Tensor, hook: Callable[..., Any]) -> Any:
    where = getattr(hook, "__qualname__", repr(hook))
    code = getattr(hook, "__code__", None)
    if code is not None:
        where += f" ({code.co_filename}:{code.co_firstlineno})"
    raise CustomGradError(f"Tensor.register_hook({where}) inside the compiled forward: the hook would change "
                          "the gradient where the captured graph cannot see it. Put the gradient change in a "
                          "torch.autograd.Function (whose backward tpudist runs), or apply the hook outside "
                          "the compiled module")


def check_backward_hooks(module: torch.nn.Module) -> None:
    """Raises CustomGradError for module backward hooks, which a compiled module would never call."""
    from torch.nn.modules import module as module_module
    if module_module._global_backward_hooks or module_module._global_backward_pre_hooks:
        raise CustomGradError("a global module backward hook (torch.nn.modules.module.register_module_full_"
                              "backward_hook) is registered; tpudist's backward would not call it. Remove it "
                              "for the compiled module")
    for name, sub in module.named_modules():
        if sub._backward_hooks or sub._backward_pre_hooks:
            raise CustomGradError(f"module '{name or type(module).__name__}' ({type(sub).__name__}) has a backward "
                                  "hook (register_full_backward_hook / register_backward_hook / "
                                  "register_full_backward_pre_hook); tpudist's backward would not call it. Remove "
                                  "it, or hook the module's output tensors outside the compiled module")


def check_parameter_hooks(module: torch.nn.Module) -> None:
    """Raises CustomGradError for gradient hooks on parameters, which only torch's autograd engine
    runs (so `tpudist.compile(module)` honours them; the fused step, which never runs it, cannot)."""
    for name, parameter in module.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            raise CustomGradError(f"parameter '{name}' has a gradient hook (register_hook / "
                                  "register_post_accumulate_grad_hook); the fused step computes and applies "
                                  "gradients without torch's autograd, so it would never run. Remove it, or train "
                                  "with tpudist.compile(model) and a torch optimizer, whose backward runs it")


@contextlib.contextmanager
def intercepted() -> Iterator[None]:
    """While capturing: custom Functions become one node each, checkpoints marked regions, tensor
    hooks an error. Nested (a Function's own capture) and thread-confined (the patches are global,
    so captures in two threads at once are refused)."""
    depth = getattr(_active, "depth", 0)
    if depth:
        _active.depth = depth + 1
        try:
            yield
        finally:
            _active.depth = depth
        return
    with _lock:
        function = torch.autograd.function.Function
        saved = (function.__dict__["apply"], checkpoint_module._checkpoint_without_reentrant_generator,
                 torch.Tensor.register_hook, getattr(checkpoint_module, _IMPL, None))
        function.apply = classmethod(_apply)
        checkpoint_module._checkpoint_without_reentrant_generator = _non_reentrant
        if saved[3] is not None:  # (torch >= 2.14: what checkpoint() calls)
            setattr(checkpoint_module, _IMPL, _non_reentrant)
        torch.Tensor.register_hook = _register_hook
        _active.depth = 1
        try:
            yield
        finally:
            _active.depth = 0
            function.apply = saved[0]
            checkpoint_module._checkpoint_without_reentrant_generator = saved[1]
            torch.Tensor.register_hook = saved[2]
            if saved[3] is not None:
                setattr(checkpoint_module, _IMPL, saved[3])


_lock = threading.Lock()
_IMPL = "_checkpoint_without_reentrant_generator_impl"

