"""A custom autograd.Function's own forward and backward, captured and lowered to a jax.custom_vjp.

`_custom_grad` turns each `Function.apply` met while capturing into one `tpudist::autograd_function`
node and records the call. Here, once the graph is captured, each call's `forward` (run with a
stand-in ctx, returning its outputs and what it saved) and its `backward` (fed those and the output
cotangents) are captured as graphs of their own and lowered; the node's lowering is a
`jax.custom_vjp` whose VJP is the lowered backward, so JAX's autodiff of the whole graph uses the
Function's gradient, not the derivative of its forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tpudist.compile._torch.lowering._custom_grad import (
    _CALLS,
    _CTX_OWN,
    AUTOGRAD_FUNCTION,
    CustomGradError,
    FunctionCall,
    _Ctx,
)


class _ForwardOf(torch.nn.Module):
    """The Function's forward as a module: tensors in; outputs, then what backward needs, out."""

    def __init__(self, call: FunctionCall):
        super().__init__()
        self.call = call

    def forward(self, *tensors: torch.Tensor) -> tuple:
        call = self.call
        ctx = _Ctx(call.needs_input_grad)
        with _ClosedOverParameters(call):
            outputs = call.run_forward(ctx, list(tensors))
        saved = tuple(ctx.to_save)
        attrs = {k: v for k, v in vars(ctx).items() if k not in _CTX_OWN}
        call.saved = [isinstance(s, torch.Tensor) for s in saved]
        call.tensor_attrs = sorted(k for k, v in attrs.items() if isinstance(v, torch.Tensor))
        call.statics = {k: v for k, v in attrs.items() if not isinstance(v, torch.Tensor)}
        call.saved_statics = [None if isinstance(s, torch.Tensor) else (s,) for s in saved]
        return (*outputs, *(s for s in saved if isinstance(s, torch.Tensor)), *(attrs[k] for k in call.tensor_attrs))


class _ClosedOverParameters(torch.overrides.TorchFunctionMode):
    """Refuses a tensor that requires grad but is not one of the traced arguments (a parameter the
    Function reads from a closure or a global): captured, it would be a constant, its gradient lost."""

    def __init__(self, call: FunctionCall):
        super().__init__()
        self.call = call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        for value in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(value, FakeTensor):
                raise CustomGradError(f"custom autograd.Function {self.call.name} reads a tensor that requires grad "
                                      f"({tuple(value.shape)} {value.dtype}) without taking it as an argument; pass "
                                      "it to apply(), so its gradient comes from the Function's backward")
        return func(*args, **(kwargs or {}))


class _BackwardOf(torch.nn.Module):
    """The Function's backward as a module: residuals and output cotangents in; the gradient of each
    floating tensor argument that backward does not leave as None out."""

    def __init__(self, call: FunctionCall, inputs: list[torch.Tensor], n_residuals: int):
        super().__init__()
        self.call, self.inputs, self.n_residuals = call, inputs, n_residuals

    def forward(self, *flat: torch.Tensor) -> tuple:
        call = self.call
        residuals, cotangents = flat[:self.n_residuals], flat[self.n_residuals:]
        ctx = _Ctx(call.needs_input_grad)
        it = iter(residuals)
        ctx.to_save = tuple(next(it) if slot is None else slot[0] for slot in call.saved_statics)
        for name in call.tensor_attrs:
            setattr(ctx, name, next(it))
        for name, value in call.statics.items():
            setattr(ctx, name, value)
        grads = call.cls.backward(ctx, *cotangents)
        grads = grads if isinstance(grads, tuple) else (grads,)
        tensor_positions = [i for i, slot in enumerate(call.layout) if slot is None]
        if len(grads) < len(call.layout) or any(g is not None for g in grads[len(call.layout):]):
            raise CustomGradError(f"backward returned {len(grads)} gradients for {len(call.layout)} inputs")
        out, call.grad_positions = [], []
        for k, (i, example) in enumerate(zip(tensor_positions, self.inputs)):
            g = grads[i]
            if g is None or not (example.is_floating_point() or example.is_complex()):
                continue
            if tuple(g.shape) != tuple(example.shape):  # torch's engine sums a broadcast gradient back
                g = g.sum_to_size(example.shape)
            out.append(g.to(example.dtype))
            call.grad_positions.append(k)
        return tuple(out)


def prepare(graph: torch.fx.Graph, capture: Callable[..., Any], lower: Callable[..., Any]) -> None:
    """Captures and lowers the forward and backward of every custom Function call in `graph`
    (from `capture`: nested calls are prepared by their own capture)."""
    for node in graph.nodes:
        if node.target is AUTOGRAD_FUNCTION:
            call = _CALLS[node.args[0]]
            if call.forward_fn is None:
                _prepare(call, [_example(n.meta["val"]) for n in node.args[1]], capture, lower)


def _example(value: torch.Tensor) -> torch.Tensor:
    return torch.zeros(value.shape, dtype=value.dtype)


def _prepare(call: FunctionCall, inputs: list[torch.Tensor], capture: Callable[..., Any],
             lower: Callable[..., Any]) -> None:
    where = f" (in custom autograd.Function {call.name})"
    forward = capture(_ForwardOf(call), tuple(inputs), {}, where=where)
    outputs = [n.meta["val"] for n in next(n for n in forward.graph.nodes if n.op == "output").args[0]]
    call.output_dtypes = [o.dtype for o in outputs[:len(outputs) - _residual_count(call)]]
    residuals = [_example(o) for o in outputs[len(call.output_dtypes):]]
    cotangents = [_example(o) for o in outputs[:len(call.output_dtypes)]]
    backward = capture(_BackwardOf(call, inputs, len(residuals)), tuple(residuals + cotangents), {}, where=where)
    call.forward_fn, call.backward_fn = _runner(forward, lower), _runner(backward, lower)
    call.random = forward.has_random or backward.has_random


def _residual_count(call: FunctionCall) -> int:
    return sum(call.saved) + len(call.tensor_attrs)


def _runner(captured: Any, lower: Callable[..., Any]) -> Callable[[list[Any], Any], tuple]:
    """`run(tensors, key)` for a sub-capture: its user inputs given, its lifted constants filled in."""
    import jax.numpy as jnp

    from tpudist.compile._torch._convert import jax_dtype
    run = lower(captured)
    slots = [slot for slot in captured.inputs if slot.kind != "literal"]
    constants = {slot.name: jnp.asarray(captured.constants[slot.name].detach().numpy(),
                                        jax_dtype(captured.constants[slot.name].dtype))
                 for slot in slots if slot.kind == "constant"}

    def call(tensors: list[Any], key: Any) -> tuple:
        arguments = [tensors[slot.leaf] if slot.kind == "input" else constants[slot.name] for slot in slots]
        return run(arguments, key)

    return call


# -- the lowering ----------------------------------------------------------------------------------

def _lower_call(*args: Any) -> list[Any]:
    """`tpudist::autograd_function` as a jax.custom_vjp: the lowered forward, and for its VJP the
    lowered backward applied to the forward's residuals (the key, when either draws random numbers,
    arrives first, as for every random op)."""
    import jax
    import jax.numpy as jnp

    from tpudist.compile._torch.lowering.ops._util import custom_vjp
    key, call_id, tensors = args if len(args) == 3 else (None, *args)
    call = _CALLS[call_id]
    n_out = len(call.output_dtypes)

    def forward(key: Any, tensors: tuple) -> tuple:
        outs = call.forward_fn(list(tensors), key)
        return tuple(outs[:n_out]), tuple(outs[n_out:])

    @custom_vjp  # (jax.custom_vjp that holds inside the fused step's shard_map)
    def function(key: Any, tensors: tuple) -> tuple:
        return forward(key, tensors)[0]

    def function_fwd(key: Any, tensors: tuple) -> tuple:
        outputs, residuals = forward(key, tensors)
        return outputs, (key, residuals)

    def function_bwd(saved: tuple, cotangents: tuple) -> tuple:
        key, residuals = saved
        cotangents = [jnp.zeros(c.shape, o.dtype) if c.dtype == jax.dtypes.float0 else c
                      for c, o in zip(cotangents, outputs_like)]
        grads = call.backward_fn([*residuals, *cotangents], None if key is None else jax.random.fold_in(key, 1))
        full: list[Any] = [None] * len(tensors)
        for position, g in zip(call.grad_positions, grads):
            full[position] = g
        return None, tuple(full)

    function.defvjp(function_fwd, function_bwd)
    outputs_like = [jax.ShapeDtypeStruct((), jnp.dtype(_jax_dtype(d))) for d in call.output_dtypes]
    return list(function(key, tuple(tensors)))


def _jax_dtype(dtype: torch.dtype) -> Any:
    from tpudist.compile._torch._convert import jax_dtype
    return jax_dtype(dtype)


def _register() -> None:
    from tpudist.compile._torch.lowering._table import register
    register(AUTOGRAD_FUNCTION, random=lambda node: _CALLS[node.args[0]].random)(_lower_call)


_register()
