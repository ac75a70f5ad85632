"""The autograd glue: a torch.autograd.Function whose forward and backward are XLA executables.

Forward runs `jax.vjp` of the lowered graph inside one jitted executable, which returns the
outputs and the VJP closure holding the residuals XLA chose to keep; backward runs a second
executable applying that closure to the incoming gradients. torch's autograd engine then
accumulates the results into the original parameters' `.grad`, so torch.optim works unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import torch
from torch.autograd.function import once_differentiable

from tpudist.compile._torch._convert import to_torch


class XlaCall:
    """One call's state, shared by the Function's forward and the code that called it.

    executables: the graph's (see _executables.Executables); arrays: every tensor input as a JAX array;
    diff: positions in `arrays` to differentiate; seed: the per-call RNG seed; where: the device the
    call computes on (its backward runs there too, beside the forward's residuals).
    After forward, `first` is one of the executable's outputs (to wait for it later) and `rest`
    holds the outputs that bypass autograd (non-float user outputs, buffer and input updates), in
    the graph's order of non-differentiable outputs.
    """

    def __init__(self, executables: Any, arrays: list[jax.Array], diff: tuple[int, ...], seed: Any, where: Any):
        self.executables, self.arrays, self.diff, self.seed, self.where = executables, arrays, diff, seed, where
        self.rest: list[jax.Array] = []
        self.first: jax.Array | None = None


class XlaFunction(torch.autograd.Function):
    """`XlaFunction.apply(call, *diff_tensors)` -> the differentiable (floating) user outputs."""

    @staticmethod
    def forward(ctx: Any, call: XlaCall, *diff_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # no explicit wait: converting an output to torch (here, and `rest` by the caller) waits
        # for the executable, after which XLA no longer reads the input views
        primal, rest, vjp = call.executables.forward_with_vjp(call.diff, call.arrays, call.seed, call.where)
        call.rest = list(rest)
        call.first = primal[0]
        ctx.packing = call.executables.packing(call.diff, call.arrays)
        call.arrays = None  # drop the input views: only the VJP's residuals stay alive
        ctx.vjp, ctx.executables, ctx.diff, ctx.where = vjp, call.executables, call.diff, call.where
        ctx.input_dtypes = [t.dtype for t in diff_tensors]
        # outputs the loss does not use come back as None (not zeros): the inputs only they reach
        # get no gradient, as in eager torch
        ctx.set_materialize_grads(False)
        ctx.output_like = [(a.shape, dtype) for a, dtype in zip(primal, call.executables.float_output_dtypes)]
        # saved only for torch's version check: stepping the optimizer between this forward and
        # its backward must fail as loudly as it does in eager torch
        ctx.save_for_backward(*diff_tensors)
        return tuple(to_torch(a, dtype) for a, dtype in zip(primal, call.executables.float_output_dtypes))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.saved_tensors  # raises if a differentiated tensor was modified in place since forward
        vjp, ctx.vjp = ctx.vjp, None  # the residuals are freed as soon as they are used
        if vjp is None:
            raise RuntimeError("torch -> XLA: a second backward through the same compiled forward; its "
                               "residuals are freed by the first (retain_graph=True is not supported). "
                               "Run the compiled module again, or sum the losses and call backward once.")
        used = tuple(i for i, g in enumerate(grads) if g is not None)
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype)
                 for g, (shape, dtype) in zip(grads, ctx.output_like)]
        results = ctx.executables.backward(vjp, grads, ctx.packing, ctx.input_dtypes, ctx.where)
        reached = ctx.executables.reached(ctx.diff, used)
        return (None, *(g if keep else None for g, keep in zip(results, reached)))
