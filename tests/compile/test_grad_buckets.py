"""The data-parallel step's gradient all-reduce in buckets (`TPUDIST_GRAD_BUCKET_MB`): the same
averages as one all-reduce per array, on 2 processes x 2 devices."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh

SHAPES = [(3,), (40, 7), (5, 5, 2), (1,), (300,), (2, 2)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32]


def bucketed(bucket_bytes: int) -> list:
    """Each device's arrays (drawn from its own seed), averaged by bucketed_mean; and every
    device's arrays, drawn again on the host, for numpy."""
    from tpudist.compile._torch.train._body import bucketed_mean
    mesh = tpudist.mesh.make_mesh({"data": -1})
    devices = mesh.devices.size

    def draw(seed):
        key = jax.random.PRNGKey(seed)
        return [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(d)
                for i, (s, d) in enumerate(zip(SHAPES, DTYPES))]

    def per_device(seed):
        return [m[None] for m in bucketed_mean(draw(seed[0]), "data", bucket_bytes)]

    step = tpudist.compile(per_device, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"), per_device=True)
    local = np.arange(jax.process_index() * jax.local_device_count(),
                      (jax.process_index() + 1) * jax.local_device_count(), dtype=np.int32)
    means = step(local)
    every = [draw(seed) for seed in range(devices)]  # what each device drew, drawn again here
    return [np.asarray(m.addressable_shards[0].data[0], np.float32) for m in means], \
        [np.stack([np.asarray(d[i], np.float32) for d in every]) for i in range(len(SHAPES))]


def test_buckets_average_as_one_all_reduce_per_array():
    for bucket in (0, 64, 1 << 20):  # one per array; several buckets per dtype; one per dtype
        for means, values in run_on_mesh(bucketed, nprocs=2, cpu_devices=2, kwargs={"bucket_bytes": bucket}):
            for mean, value, dtype in zip(means, values, DTYPES):
                tol = 1e-6 if dtype == jnp.float32 else 1e-2
                np.testing.assert_allclose(mean, value.mean(axis=0), rtol=tol, atol=tol)


def train(bucket_mb: str) -> dict:
    os.environ["TPUDIST_GRAD_BUCKET_MB"] = bucket_mb
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1 + jax.process_index())
    for _ in range(3):
        step((torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)))
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def test_the_fused_step_trains_the_same_with_or_without_buckets():
    bucketed_state = run_on_mesh(train, nprocs=2, cpu_devices=2, kwargs={"bucket_mb": "25"})[0]
    per_array = run_on_mesh(train, nprocs=2, cpu_devices=2, kwargs={"bucket_mb": "0"})[0]
    for name, value in per_array.items():  # gloo may sum a larger buffer in another order: float32 rounding
        np.testing.assert_allclose(bucketed_state[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
