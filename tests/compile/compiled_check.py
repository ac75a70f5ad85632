"""The shared check of the per-op tests: a function through `tpudist.compile` against eager torch.

`check_compiled(fn, *inputs)` runs `fn` eagerly and as a compiled module on copies of the same
inputs and compares every output (NaN where torch has NaN, integers exactly, complex values by
their parts), then the gradient of each floating input for a fixed random projection of the
differentiable real outputs.

`assert_as_accurate_as_eager(got, eager, exact)` judges results of a longer computation (a few
training steps) against eager torch by eager's own float32 error: `exact` is the same eager
program in float64.
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


# -- tolerances from eager torch's own float32 error ----------------------------------------------------

EPS32 = float(torch.finfo(torch.float32).eps)  # one unit in the last place (ulp) at 1.0
FACTOR, ULPS = 8.0, 32.0


def deviation_beyond_eager(got: Any, eager: Any, exact: Any, factor: float = FACTOR, ulps: float = ULPS) -> str | None:
    """Why `got` is less accurate than eager torch in float32, or None where it is not.

    `got` (the compiled float32 result), `eager` (eager torch's float32 result) and `exact` (the same
    eager program in float64) are tensors or arrays of one shape. `got` may be `factor` times as far
    from `exact` as `eager` is (the largest element-wise deviation of each), plus `ulps` float32 units
    in the last place of `exact`'s largest magnitude. The OpInfo harness's rule, on the largest
    deviation instead of the norm. A fixed tolerance fails where float32 rounding is large and hides
    a bug where it is small: AdamW's first steps divide by sqrt(v) of small gradients, so a few steps
    amplify the gradients' rounding (a Llama's layers.1.mlp.down_proj after 3 steps: eager float32
    7e-6 from float64, the sharded step under FSDP x TP 2.9e-5; a fixed 2e-5 failed on some machines).

    Why 8x and 32 ulps: the sharded step sums in other orders (over shards, in XLA's CPU kernels)
    and lands a median 1.5-3x eager's deviation on the sharded Llama's tensors, up to ~4x where that
    deviation is well above rounding; where eager float32 happens to land next to float64 (a v_proj
    6e-8 from it, the sharded step 5e-7: 8x) the ulps carry it. Measured there, no tensor used more
    than 2/3 of this allowance. A real bug moves a result by the size of an update (lr times order
    1), not by rounding: each process stepping on its own half of the batch (a missing all-reduce)
    lands >= 300x beyond the allowance, one skipped AdamW step >= 50x (test_sharded_step.py checks
    that both stay beyond 10x it).
    """
    got, eager, exact = (torch.as_tensor(t).detach().double() for t in (got, eager, exact))
    if got.shape != exact.shape:
        return f"shape {tuple(got.shape)}, float64 eager {tuple(exact.shape)}"
    error, floor = float((got - exact).abs().max()), float((eager - exact).abs().max())
    scale = float(exact.abs().max())
    allowed = factor * floor + ulps * EPS32 * scale
    if error <= allowed:
        return None
    return (f"{error:.2e} from float64 eager, eager float32 {floor:.2e} (allowed {factor:g}x that + "
            f"{ulps:g} ulps of {scale:.2e} = {allowed:.2e})")


def assert_as_accurate_as_eager(got: dict[str, Any], eager: dict[str, Any], exact: dict[str, Any],
                                factor: float = FACTOR, ulps: float = ULPS) -> None:
    """`deviation_beyond_eager` for every name of `exact`; one assertion listing every tensor that fails."""
    failures = [f"{name}: {why}" for name in exact
                if (why := deviation_beyond_eager(got[name], eager[name], exact[name], factor, ulps))]
    assert not failures, "less accurate than eager torch in float32:\n" + "\n".join(failures)
