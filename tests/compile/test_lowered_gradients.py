"""Gradients the lowerings define themselves (a custom VJP, where JAX's derivative of the forward
is not torch's gradient) equal eager torch's: through `tpudist.compile` and inside the fused train
step, whose shard_map gives every value the mesh axes it varies over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from test_torch_fused import assert_same_state, eager_train


class Ctc(nn.Module):
    """CTC on log-probabilities given as they are: torch's gradient with respect to them is not the
    derivative of its loss (it assumes a log_softmax before), and the compiled one must be torch's."""

    def __init__(self, zero_infinity: bool = False):
        super().__init__()
        self.zero_infinity = zero_infinity

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none",
                          zero_infinity=self.zero_infinity)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_gradient_of_log_probs_is_torchs(zero_infinity):
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(8, 3, 5, generator=g) * 2  # not normalized: torch's formula shows
    targets = torch.tensor([[1, 2, 2], [3, 0, 0], [4, 4, 4]])  # the last needs 5 frames: impossible in 4
    lengths = (torch.tensor([8, 6, 4]), torch.tensor([3, 1, 3]))
    a, b = log_probs.clone().requires_grad_(), log_probs.clone().requires_grad_()
    got = tpudist.compile(Ctc(zero_infinity))(a, targets, *lengths)
    want = Ctc(zero_infinity)(b, targets, *lengths)
    torch.testing.assert_close(got, want)
    weights = torch.tensor([0.5, -1.5, 2.0])
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


class Unpooled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        pooled, indices = self.pool(self.conv(x))
        return self.head(self.unpool(pooled, indices).flatten(1))


def test_max_unpool_trains_in_the_fused_step_as_in_eager_torch():
    # max_unpool scatters into zeros that vary over no mesh axis; its gradient comes from the step's
    # per-device cotangent, which does
    model, ref = Unpooled(), Unpooled()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    losses = [step(batch).item() for batch in data]
    torch.testing.assert_close(losses, eager_train(ref, ref_opt, data), rtol=1e-5, atol=1e-6)
    assert_same_state(model, ref, atol=1e-5)
