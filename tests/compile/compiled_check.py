"""The shared check of the per-op tests: a function through `tpudist.compile` against eager torch.

`check_compiled(fn, *inputs)` runs `fn` eagerly and as a compiled module on copies of the same
inputs and compares every output (NaN where torch has NaN, integers exactly, complex values by
their parts), then the gradient of each floating input for a fixed random projection of the
differentiable real outputs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

import tpudist


class Fn(torch.nn.Module):
    """A module calling `fn`: what `tpudist.compile` takes."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def leaves(value: Any) -> list[Any]:
    return tree_flatten(value)[0]


def check_compiled(fn: Callable[..., Any], *inputs: torch.Tensor, grad: bool = True, rtol: float = 1e-5,
                   atol: float = 1e-5, constant: tuple[int, ...] = ()) -> None:
    """`constant`: positions of floating inputs not differentiated (e.g. a sampling grid)."""
    def fresh() -> list[torch.Tensor]:
        return [t.detach().clone().requires_grad_(grad and t.is_floating_point() and i not in constant)
                for i, t in enumerate(inputs)]

    eager_in, xla_in = fresh(), fresh()
    want, got = leaves(fn(*eager_in)), leaves(tpudist.compile(Fn(fn))(*xla_in))
    assert len(want) == len(got), (len(got), len(want))
    generator = torch.Generator().manual_seed(0)
    eager_loss: Any = 0.0
    xla_loss: Any = 0.0
    for i, (w, g) in enumerate(zip(want, got)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (i, g.dtype, g.shape, w.dtype, w.shape)
        torch.testing.assert_close(g.detach().resolve_conj(), w.detach().resolve_conj(), rtol=rtol, atol=atol,
                                   equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}")
        if w.requires_grad and w.is_floating_point():
            weight = torch.randn(w.shape, generator=generator, dtype=w.dtype)
            eager_loss, xla_loss = eager_loss + (w * weight).sum(), xla_loss + (g * weight).sum()
    if grad and isinstance(eager_loss, torch.Tensor):
        eager_loss.backward()
        xla_loss.backward()
        for i, (e, x) in enumerate(zip(eager_in, xla_in)):
            if e.requires_grad:
                torch.testing.assert_close(x.grad, e.grad, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, i=i: f"gradient of input {i}: {m}")
