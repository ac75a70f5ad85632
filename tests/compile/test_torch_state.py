"""The fused step keeps its state on the devices (issue-level contract of docs/torch_training.md).

With torch unable to view device memory (forced on CPU: `_state.HOST_VIEW = False`, as on a TPU), a
run of steps crosses nothing to the host: the counter on the crossing helper stays still until a
door (`state_dict()`, an eager call, `step.sync()`) is opened, which crosses each array once; the
results still equal eager torch. The loss comes back without waiting for the step; batches can be
moved to the devices ahead of it (`tpudist.device_loader`).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist.compile._torch.train import _state


def model() -> nn.Module:
    torch.manual_seed(0)
    # no bias before BatchNorm: its gradient is zero but for rounding, which Adam would amplify
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def data(count: int = 6, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(count)]


def eager(m: nn.Module, opt: torch.optim.Optimizer, batches) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def no_host_view(monkeypatch):
    """Stand-in for a device torch cannot view (a TPU): every crossing is a copy, counted."""
    monkeypatch.setattr(_state, "HOST_VIEW", False)
    _state.crossings.clear()
    yield _state.crossings


def test_steps_cross_nothing_to_the_host_until_a_door_is_opened(no_host_view):
    m, ref = model(), model()
    opt, ref_opt = torch.optim.Adam(m.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    step = tpudist.compile_train_step(m, F.cross_entropy, opt)
    batches = data()
    losses = [step(b) for b in batches[:3]]
    assert no_host_view["to_host"] == 0                     # three steps, nothing read back
    state = m.state_dict()                                  # a door: one crossing per array
    arrays = len(list(m.parameters())) * 3 + 1 + 3  # params, Adam's 2 moments, step counts, BN's 3 buffers
    assert no_host_view["to_host"] == arrays
    torch.testing.assert_close(state, copy.deepcopy(state))  # torch tensors, usable as usual
    m.state_dict()                                          # nothing changed since: no crossing
    assert no_host_view["to_host"] == arrays
    more = [step(b) for b in batches[3:]]
    assert no_host_view["to_host"] == arrays                # the next steps again cross nothing
    ref_losses = eager(ref, ref_opt, batches)
    np.testing.assert_allclose([float(loss) for loss in losses + more], ref_losses, rtol=1e-5)
    assert no_host_view["to_host"] == arrays + len(batches)  # one crossing per loss actually read
    for (name, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=2e-6, err_msg=name)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for index in want:
        for field in want[index]:
            np.testing.assert_allclose(np.asarray(got[index][field]), np.asarray(want[index][field]),
                                       rtol=1e-5, atol=2e-6, err_msg=f"{index} {field}")


def test_doors_eager_calls_edits_and_loads_are_seen_by_both_sides():
    m, ref = model(), model()
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt, ref_opt = make(m.parameters()), make(ref.parameters())
    step = tpudist.compile_train_step(m, F.cross_entropy, opt)
    batches = data(count=8)
    for b in batches[:2]:
        step(b)
    eager(ref, ref_opt, batches[:2])
    # an eager call of the model (here a submodule) sees the trained values
    x = batches[0][0]
    m.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(m[0](x), ref[0](x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-6)
    m.train()
    ref.train()
    # after a door, an edit from torch is used by the next step; so is a checkpoint loaded back
    checkpoint = copy.deepcopy((m.state_dict(), opt.state_dict()))
    with torch.no_grad():
        m[3].bias.add_(1.0)
        ref[3].bias.add_(1.0)
    for b in batches[2:4]:
        step(b)
    eager(ref, ref_opt, batches[2:4])
    m.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    ref_copy = copy.deepcopy(checkpoint)
    ref.load_state_dict(ref_copy[0])
    ref_opt.load_state_dict(ref_copy[1])
    for b in batches[4:]:
        step(b)
    eager(ref, ref_opt, batches[4:])
    for (name, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=2e-6, err_msg=name)
    assert step.stats.state_reloads >= 2
    # step.sync(): the parameters themselves (read without a door) are current after it
    step(batches[0])
    eager(ref, ref_opt, batches[:1])
    step.sync()
    np.testing.assert_allclose(m[0].weight.detach().numpy(), ref[0].weight.detach().numpy(), rtol=1e-5, atol=2e-6)


def test_the_loss_is_a_lazy_scalar_that_reads_like_a_tensor():
    m = model()
    step = tpudist.compile_train_step(m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = data(count=1)[0]
    loss = step((x, y))
    assert isinstance(loss, tpudist.LazyScalar)
    value = loss.item()
    assert float(loss) == value == loss.detach().cpu().item() and f"{loss:.3f}" == f"{value:.3f}"
    assert torch.equal(torch.stack([loss.tensor(), loss.tensor()]), torch.tensor([value, value]))
    assert (loss + 1).item() == pytest.approx(value + 1) and loss < value + 1 and loss.double().dtype == torch.float64
    assert np.asarray(loss).dtype == np.float32 and loss.shape == torch.Size([])


def test_device_loader_prefetches_the_batches_the_step_expects_and_stops_cleanly():
    import threading
    m, ref = model(), model()
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    step, ref_opt = tpudist.compile_train_step(m, F.cross_entropy, make(m.parameters())), make(ref.parameters())
    batches = data(count=5)
    seen = []
    for batch in tpudist.device_loader(batches):
        assert isinstance(batch, tpudist.DeviceBatch) and batch.rows == 8
        for got, want in zip(batch.torch(), batches[len(seen)]):
            assert torch.equal(got, want)
        seen.append(step(batch))
    eager(ref, ref_opt, batches)
    for (name, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=2e-6, err_msg=name)
    assert step.stats.compiles == 1
    # a loop that breaks early: the thread stops; a loader that raises: its own error, here
    loader = tpudist.device_loader(iter(data(count=50)))
    next(loader)
    loader.close()
    assert not any(t.name == "tpudist-device-loader" and t.is_alive() for t in threading.enumerate())

    def broken():
        yield batches[0]
        raise KeyError("corrupt record 7")

    with pytest.raises(KeyError, match="corrupt record 7"):
        for batch in tpudist.device_loader(broken()):
            step(batch)
    with pytest.raises(ValueError, match="different leading sizes"):
        next(tpudist.device_loader([(torch.zeros(4, 6), torch.zeros(3))]))
