"""A batch handed to the fused step, or to `tpudist.device_loader`, may be written by its owner as
soon as the call returns: a loop that refills one preallocated tensor in place for every step
must train exactly as eager torch does on the same sequence of batches. The step runs
asynchronously, so the values must be taken at the call, whatever the batch's size (small
batches are copied into reused buffers, larger ones cross as copies of their own)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpudist

STEPS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _eager_losses(model: torch.nn.Module, data: list) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _refilled(data: list, x: torch.Tensor, y: torch.Tensor):
    """One (x, y) pair of tensors, refilled in place with each batch of `data` in turn."""
    for a, b in data:
        x.copy_(a)
        y.copy_(b)
        yield x, y


# rows of 512 float32: 32 KiB (copied into reused buffers), 128 KiB and 512 KiB (their own copies)
@pytest.mark.parametrize("rows", [16, 64, 256])
@pytest.mark.parametrize("through_loader", [False, True])
def test_a_batch_refilled_in_place_after_each_call_trains_as_in_eager_torch(rows, through_loader):
    g = torch.Generator().manual_seed(rows)
    data = [(torch.randn(rows, 512, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(STEPS)]
    model, reference = _model(), _model()
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    batches = _refilled(data, torch.empty(rows, 512), torch.empty(rows, dtype=torch.long))
    # no loss is read before the last step is queued: the steps run behind the loop
    losses = [step(batch) for batch in (tpudist.device_loader(batches) if through_loader else batches)]
    want = _eager_losses(reference, copy.deepcopy(data))
    np.testing.assert_allclose([float(loss) for loss in losses], want, rtol=1e-5)
    for (name, got), want_value in zip(model.state_dict().items(), reference.state_dict().values()):
        np.testing.assert_allclose(got.numpy(), want_value.numpy(), rtol=1e-5, atol=2e-6, err_msg=name)
