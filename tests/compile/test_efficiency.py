"""The efficiency report: a step's FLOPs against counts made by hand, the device peaks MFU divides
by, and `fit`'s tokens/s, MFU and goodput against the times and counts they come from."""

from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist import contract
from tpudist.compile._efficiency import device_peak_flops, model_flops, xla_flops

B = 64  # rows of every batch below


def _matmul_step(model: nn.Module, accumulate_steps: int = 1):
    torch.manual_seed(0)
    step = tpudist.compile_train_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.01),
                                      accumulate_steps=accumulate_steps)
    width = model[0].in_features
    out = model[-1].out_features
    float(step((torch.randn(B, width), torch.randn(B, out))))
    return step


def test_a_steps_flops_are_its_matmuls_counted_by_hand():
    # two layers of different widths: forward x @ W1, h @ W2; backward dW2, dh, dW1 (the batch
    # needs no gradient): 2 * B * k * n for each
    step = _matmul_step(nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 64, bias=False)))
    assert step.stats.flops_per_step == 2 * B * (2 * 256 * 128 + 3 * 128 * 64)
    # the batch in 2 micro-batches of B/2 rows, their gradients summed: the same work
    step = _matmul_step(nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 64, bias=False)), 2)
    assert step.stats.flops_per_step == 2 * B * (2 * 256 * 128 + 3 * 128 * 64)


def test_a_scanned_stack_counts_every_layer():
    # identical layers run as one loop (lax.scan) whose body XLA's cost analysis counts once: the
    # count here has both layers, and the first layer's input gradient, which the loop computes
    # for every layer (forward, dW and dX: 3 matmuls a layer)
    step = _matmul_step(nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)]))
    assert step.stats.flops_per_step == 4 * 3 * 2 * B * 256 * 256
    assert xla_flops(step._last.program.executable) < 0.5 * step.stats.flops_per_step


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("padding,stride", [("VALID", 1), ("SAME", 1), ("SAME", 2)])
def test_a_convolution_counts_as_xla_does_and_its_gradient_thrice(groups, padding, stride):
    """XLA's cost analysis counts a convolution's taps that meet the input, not the padding: the
    forward count agrees with it exactly; the two gradients (input and weight) cost one forward
    each, whatever the padding, stride and groups."""
    x, w = jnp.ones((4, 8, 10, 10)), jnp.ones((16, 8 // groups, 3, 3))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), padding, feature_group_count=groups,
                                            dimension_numbers=("NCHW", "OIHW", "NCHW"))
    forward = jax.jit(conv).trace(x, w)
    flops = model_flops(forward.jaxpr, 1)
    assert flops == xla_flops(forward.lower().compile())
    both = jax.jit(jax.grad(lambda x, w: (conv(x, w) ** 2).sum(), argnums=(0, 1))).trace(x, w)
    assert model_flops(both.jaxpr, 1) == 3 * flops


def test_a_loop_of_unknown_length_gives_no_count():
    loop = jax.jit(lambda x, n: jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0])
    assert model_flops(loop.trace(jnp.ones((4, 4)), 3).jaxpr, 1) is None


def test_peaks_by_device_kind_and_the_override(monkeypatch):
    tpu = SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")  # stand-in: no TPU here (the kind a v5e reports)
    assert device_peak_flops(tpu) == (197e12, "TPU v5 lite, bfloat16 dense")
    assert device_peak_flops(SimpleNamespace(device_kind="NVIDIA H100 PCIe", platform="gpu"))[0] == 756e12
    peak, why = device_peak_flops(jax.devices("cpu")[0])
    assert peak is None and contract.PEAK_FLOPS in why
    peak, why = device_peak_flops(SimpleNamespace(device_kind="TPU v99", platform="tpu"))
    assert peak is None and "'TPU v99'" in why and contract.PEAK_FLOPS in why
    monkeypatch.setenv(contract.PEAK_FLOPS, "2.5e9")
    assert device_peak_flops(jax.devices("cpu")[0]) == (2.5e9, contract.PEAK_FLOPS)
    monkeypatch.setenv(contract.PEAK_FLOPS, "fast")
    with pytest.raises(ValueError, match="TPUDIST_PEAK_FLOPS='fast'"):
        device_peak_flops()


class _SlowTokens(torch.utils.data.Dataset):
    """Token ids and a label per row."""

    def __init__(self, rows: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, length), generator=g)
        self.labels = torch.randint(0, vocab, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], self.labels[i]


def test_fit_reports_tokens_mfu_and_goodput(capfd, monkeypatch, tmp_path):
    vocab, length, width, rows, batch, delay = 64, 16, 32, 128, 16, 0.1
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Flatten(), nn.Linear(length * width, vocab, bias=False))

    def slow(items):
        time.sleep(delay)
        return torch.utils.data.default_collate(items)
    loader = torch.utils.data.DataLoader(_SlowTokens(rows, length, vocab), batch_size=batch, collate_fn=slow)
    monkeypatch.setenv(contract.PEAK_FLOPS, "1e12")  # a peak to divide by (a CPU has none)
    history = tpudist.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, epochs=2,
                          checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    steps = rows // batch
    for record in history:
        assert record["tokens"] == rows * length
        assert 0 < record["data_seconds"] < record["seconds"]
        busy = record["seconds"] - record["data_seconds"] - record["compile_seconds"] - record["checkpoint_seconds"]
        assert record["goodput"] == pytest.approx(busy / record["seconds"])
        assert record["tokens_per_s"] == pytest.approx(rows * length / busy)
        # the Linear's forward, weight gradient and input gradient (on its way to the embedding's,
        # a scatter, as the lookup is a gather: no matmuls)
        assert record["flops_per_step"] == 3 * 2 * batch * length * width * vocab
        assert record["mfu"] == pytest.approx(record["flops_per_step"] * steps / (busy * 1e12))
    assert history[0]["compile_seconds"] > 0 and history[1]["compile_seconds"] == 0
    # the loader's sleeps are waits for data where the steps are quicker than it (the second epoch:
    # in the first the loader's thread runs ahead while the step compiles)
    assert history[1]["data_seconds"] >= 0.6 * steps * delay
    assert history[0]["checkpoint_seconds"] > 0  # the save after step 3
    err = capfd.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("epoch 2/2:"))
    assert f"{history[1]['tokens_per_s']:,.0f} tokens/s, MFU {100 * history[1]['mfu']:.1f}%, goodput " \
           f"{100 * history[1]['goodput']:.0f}%" in line, line
    assert "fit: goodput " in err and "GFLOPs per step and device" in err
    monkeypatch.delenv(contract.PEAK_FLOPS)
    history = tpudist.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    assert history[0]["mfu"] is None
    err = capfd.readouterr().err
    assert ", MFU n/a, goodput " in err and "MFU n/a: a CPU has no published peak" in err
