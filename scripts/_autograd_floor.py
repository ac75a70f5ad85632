"""torch's own share of a compiled forward+backward: the same caller code around a module that
computes nothing.

`bench_torch.py --vs-jax` times `tpudist.compile(model)` driven by torch's autograd the way eager
code drives it (zero the grads, call the module, the loss in torch or inside the module,
`loss.backward()` filling every parameter's `.grad`). Part of that time is torch's alone, whatever
runs the math: the module call, `autograd.Function.apply`, the loss, the autograd engine and the
accumulation into `.grad`. `Floor(model, outputs)` is a module with `model`'s parameters whose
forward hands back `outputs` (computed once, beforehand) through an `autograd.Function` and whose
backward hands back fresh, unfilled gradients (`torch.empty_like`: an allocation each, as the
bridge's gradients are, and no arithmetic). Timed with the same caller code, it is the least any
bridge that keeps torch's autograd in the loop can cost on top of the executable it waits for.

`run_forward` / `run_backward`, when given, run inside the Function's forward and backward, where a
bridge runs its executables: a bridge that splits forward and backward (the loss computed in
torch between them) can cost no less than the same split written in JAX, waited for there, plus
this floor.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _nothing() -> None:
    return None


class _Precomputed(torch.autograd.Function):
    """forward: `outputs` again (a new tensor over the same memory); backward: empty gradients.
    Each first calls its `runs` entry (forward, backward)."""

    @staticmethod
    def forward(ctx: Any, outputs: torch.Tensor, runs: tuple, *params: torch.Tensor) -> torch.Tensor:
        runs[0]()
        ctx.params, ctx.run_backward = params, runs[1]
        return outputs.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        params, ctx.params = ctx.params, None
        ctx.run_backward()
        return (None, None, *(torch.empty_like(p) for p in params))


class Floor(torch.nn.Module):
    """`model`'s parameters (the same objects) and a forward that returns `outputs`, computed
    beforehand from one batch: what torch's side of a compiled call costs with no math at all."""

    def __init__(self, model: torch.nn.Module, outputs: torch.Tensor,
                 run_forward: Callable[[], Any] = _nothing, run_backward: Callable[[], Any] = _nothing):
        super().__init__()
        self.model = model
        self._outputs = outputs.detach()
        self._params = tuple(model.parameters())
        self._runs = (run_forward, run_backward)

    def forward(self, *inputs: Any) -> torch.Tensor:
        return _Precomputed.apply(self._outputs, self._runs, *self._params)
