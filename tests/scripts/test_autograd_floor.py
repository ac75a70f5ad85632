"""scripts/_autograd_floor.py: the benchmark's measure of torch's own share of a compiled
forward+backward. It is only a fair floor if torch does for it what it does for a compiled
module: the caller's loss, the autograd engine, and one fresh `.grad` per parameter; and if it
computes none of the model's math."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from _autograd_floor import Floor  # noqa: E402 - scripts/ is not a package


class _Refuses(torch.nn.Module):
    """A model whose forward must not run: the floor hands back outputs computed beforehand."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the floor ran the model")


@pytest.mark.parametrize("loss_inside", [False, True])
def test_the_floor_goes_through_torch_autograd_like_a_compiled_call_without_the_math(loss_inside):
    torch.manual_seed(0)
    model = _Refuses()
    logits, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    expected_loss = F.cross_entropy(logits, target)
    floor = Floor(model, expected_loss if loss_inside else logits)
    x = torch.randn(4, 6)
    for _ in range(2):  # a second step: fresh gradients again, after the caller dropped the first
        for p in model.parameters():
            p.grad = None
        out = floor(x)
        loss = out if loss_inside else F.cross_entropy(out, target)
        assert loss.requires_grad and loss.grad_fn is not None
        torch.testing.assert_close(loss.detach(), expected_loss)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert [g.shape for g in grads] == [p.shape for p in model.parameters()]
        assert all(g.dtype == p.dtype for g, p in zip(grads, model.parameters()))
        assert len({g.data_ptr() for g in grads}) == len(grads)  # one gradient each, none shared


def test_the_split_floor_runs_its_forward_in_the_call_and_its_backward_in_backward():
    """`run_forward` / `run_backward` stand where a bridge that splits forward and backward runs
    its two executables: one each per step, the forward's before the caller's loss, the
    backward's while torch's engine runs `backward()`."""
    torch.manual_seed(0)
    model = _Refuses()
    logits, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    events: list[str] = []
    floor = Floor(model, logits, run_forward=lambda: events.append("forward"),
                  run_backward=lambda: events.append("backward"))
    for step in range(2):
        out = floor(torch.randn(4, 6))
        events.append("loss")
        loss = F.cross_entropy(out, target)
        assert events[-2:] == ["forward", "loss"]
        loss.backward()
        assert events == ["forward", "loss", "backward"] * (step + 1)
        assert all(p.grad is not None for p in model.parameters())
