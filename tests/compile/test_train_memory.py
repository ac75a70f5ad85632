"""`TrainStep.memory()`: the bytes the fused step holds per device, and XLA's estimate of its peak."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh

OPTIMIZERS = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 2),
}


def mlp() -> nn.Module:
    """Large weights (kept apart on one device) and small ones (packed into the pool)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 40, generator=g), torch.randint(0, 3, (rows,), generator=g)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_bytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes as a device array (int64 is int32 there unless JAX runs with x64)."""
    return tensor.numel() * np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(str(tensor.dtype)[6:]))).itemsize


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameter_and_optimizer_bytes_per_device_are_the_models(name):
    make, moments = OPTIMIZERS[name]
    model = mlp()
    step = tpudist.compile_train_step(model, F.cross_entropy, make(model.parameters()))
    for _ in range(2):
        step(batch())
    memory = step.memory()
    device = jax.devices()[0].id
    count_bytes = 4 * len(list(model.parameters()))  # one float32 step count per parameter
    assert memory.parameters == {device: parameter_bytes(model)}
    assert memory.optimizer == {device: moments * parameter_bytes(model) + count_bytes}
    assert memory.buffers == {}
    assert memory.per_device == {device: (1 + moments) * parameter_bytes(model) + count_bytes}
    assert memory.max == memory.total == memory.per_device[device]
    # a door cuts the pool into per-parameter arrays; the step's state is the same size
    model.state_dict()
    assert step.memory().parameters == memory.parameters


def test_the_executable_estimate_comes_from_the_compiled_step_without_compiling_again():
    model = mlp()
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
    step(batch())
    compiles = (step.stats.compiles, tpudist.compile_stats().compiles)
    memory = step.memory()
    assert (step.stats.compiles, tpudist.compile_stats().compiles) == compiles
    text = str(memory)
    assert "parameters" in text and "optimizer" in text
    if memory.executable is None:
        assert "not reported by this backend" in text
    else:
        x = memory.executable
        assert x.peak == x.argument + x.output + x.temp - x.alias
        assert x.peak > 0 and x.peak >= x.argument >= memory.total
        assert "peak" in text


def test_buffers_are_the_batchnorm_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    step((torch.randn(8, 6), torch.randint(0, 3, (8,))))
    memory = step.memory()
    device = jax.devices()[0].id
    assert memory.buffers == {device: sum(device_bytes(b) for b in model.buffers())}
    assert memory.parameters == {device: parameter_bytes(model)}


def test_memory_before_the_first_step_says_to_call_the_step_first():
    model = mlp()
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="call the step once first"):
        step.memory()


VOCAB, DIM = 10, 4


class BagModel(nn.Module):
    def __init__(self):
        super().__init__()
        table = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(2))
        self.emb = tpudist.nn.ShardedEmbedding.from_dense(table, mode="mean")
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def two_devices() -> dict:
    """On one process of 2 devices: every device holds a full replica of the dense parameters
    and its own half of the sharded embedding's rows."""
    out = {}
    model = mlp()
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
    step(batch())
    out["mlp"] = (step.memory(), parameter_bytes(model), len(list(model.parameters())))
    model = BagModel()
    step = tpudist.compile_train_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5))
    step((torch.randint(0, VOCAB, (8, 3)), torch.randn(8, 1)))
    out["bag"] = (step.memory(), parameter_bytes(model.head), parameter_bytes(model.emb),
                  len(list(model.parameters())))
    out["devices"] = [d.id for d in jax.local_devices()]
    return out


def test_each_device_counts_its_replica_and_its_own_rows_of_a_sharded_weight():
    (result,) = run_on_mesh(two_devices, nprocs=1, cpu_devices=2, timeout=300)
    devices = result["devices"]
    memory, params, n = result["mlp"]
    assert memory.parameters == {d: params for d in devices}
    assert memory.optimizer == {d: 2 * params + 4 * n for d in devices}
    assert memory.total == 2 * memory.max
    memory, dense, sharded, n = result["bag"]  # sharded: this process's rows, split over its 2 devices
    assert memory.parameters == {d: dense + sharded // 2 for d in devices}
    assert memory.optimizer == {d: dense + sharded // 2 + 4 * n for d in devices}
