"""tpudist.checkpoint on 2 processes x 2 CPU devices: sharded JAX state and ShardedEmbedding tables
round trip with each process writing only its own shards, and a shard one process cannot read is an
error on every process at once (not a load on one and a hang on the other)."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

import tpudist
from tpudist.checkpoint import CheckpointError

ROWS, FEATURES = 4096, 16


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _state(mesh, emb, key: int):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    params = {"tables": emb.init(jax.random.key(key)),
              "dense": jax.device_put(jnp.full((8, 4), float(key)), NamedSharding(mesh, P())),
              "rows": jax.device_put(jnp.arange(32.0).reshape(8, 4) + key, NamedSharding(mesh, P("data")))}
    return {"params": params, "opt": optax.adam(1e-3).init(params), "step": key}


def _gathered(tree):
    import jax
    from jax.experimental import multihost_utils
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                        if isinstance(x, jax.Array) else x, tree)


@pytest.mark.tpudist(nprocs=2, cpu_devices=2)
def test_sharded_state_and_embedding_round_trip_on_two_processes(tmp_path):
    import jax
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})
    emb = tpudist.ShardedEmbedding([1000, 300], FEATURES, mesh=mesh, axis="model")
    saved = _state(mesh, emb, key=1)
    tpudist.checkpoint.save(tmp_path, 10, saved)
    handle = tpudist.checkpoint.save(tmp_path, 20, _state(mesh, emb, key=2), wait=False)
    tpudist.checkpoint.wait()
    assert handle.done() and tpudist.checkpoint.latest_step(tmp_path) == 20

    like = _state(mesh, emb, key=3)
    step, restored = tpudist.checkpoint.restore(tmp_path, like=like, step=10)
    assert step == 10 and restored["step"] == 1
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
        if isinstance(want, jax.Array):
            assert got.sharding == want.sharding  # like's layout: each device got its own rows
    np.testing.assert_equal(_gathered(restored), _gathered(saved))
    for got, want in zip(emb.unshard(restored["params"]["tables"]), emb.unshard(saved["params"]["tables"])):
        np.testing.assert_array_equal(got, want)
    step, latest = tpudist.checkpoint.restore(tmp_path, like=like)
    assert step == 20 and latest["step"] == 2


@pytest.mark.tpudist(nprocs=2, cpu_devices=2)
def test_each_process_writes_only_its_own_rows_of_a_table(tmp_path):
    import jax
    rank = tpudist.process_index()
    mesh = tpudist.mesh.make_mesh({"model": -1})  # 4 devices, rows split over both processes
    emb = tpudist.ShardedEmbedding(ROWS, FEATURES, mesh=mesh, axis="model")
    table = emb.init(jax.random.key(0))
    tpudist.checkpoint.save(tmp_path, 1, {"table": table})
    table_bytes = ROWS * FEATURES * 4
    written = _bytes_under(str(tmp_path / "1" / "default" / f"ocdbt.process_{rank}"))
    assert 0.45 * table_bytes < written < 0.6 * table_bytes, (rank, written, table_bytes)
    _, restored = tpudist.checkpoint.restore(tmp_path, like={"table": emb.shard(np.zeros((ROWS, FEATURES)))})
    mine = {d: s.data for d, s in ((s.device, s) for s in restored["table"].addressable_shards)}
    for shard in table.addressable_shards:
        np.testing.assert_array_equal(np.asarray(mine[shard.device]), np.asarray(shard.data))


@pytest.mark.tpudist(nprocs=2, cpu_devices=2)
def test_a_shard_one_process_cannot_read_fails_every_process(tmp_path):
    import jax
    rank = tpudist.process_index()
    mesh = tpudist.mesh.make_mesh({"model": -1})
    emb = tpudist.ShardedEmbedding(ROWS, FEATURES, mesh=mesh, axis="model")
    state = {"table": emb.init(jax.random.key(0))}
    tpudist.checkpoint.save(tmp_path, 1, state)
    tpudist.barrier()
    if rank == 1:  # process 1's shards are lost (a truncated copy, a disk gone)
        shutil.rmtree(tmp_path / "1" / "default" / "ocdbt.process_1")
    tpudist.barrier()
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"{tmp_path}") as info:
        tpudist.checkpoint.restore(tmp_path, like=state)
    assert time.monotonic() - start < 60  # at once, not after a timeout
    if rank == 0 and "process 1 failed" in str(info.value):
        assert "so process 0 loaded nothing either" in str(info.value)
    else:
        assert "is incomplete or corrupt" in str(info.value)


@pytest.mark.tpudist(nprocs=2, cpu_devices=2)
def test_a_flipped_byte_in_one_process_s_shards_fails_every_process(tmp_path):
    import jax
    rank = tpudist.process_index()
    mesh = tpudist.mesh.make_mesh({"model": -1})
    emb = tpudist.ShardedEmbedding(ROWS, FEATURES, mesh=mesh, axis="model")
    state = {"table": emb.init(jax.random.key(0))}
    tpudist.checkpoint.save(tmp_path, 1, state)
    item = tmp_path / "1" / "default"
    manifest = (item / "_CHECKSUMS").read_text()
    assert "ocdbt.process_0/d/" in manifest and "ocdbt.process_1/d/" in manifest  # both stores
    tpudist.barrier()
    if rank == 1:  # bit rot in process 1's data
        store = str(item / "ocdbt.process_1" / "d")
        data = max((os.path.join(store, f) for f in os.listdir(store)), key=os.path.getsize)
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    tpudist.barrier()
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"{tmp_path}") as info:
        tpudist.checkpoint.restore(tmp_path, like=state)
    assert time.monotonic() - start < 60  # at once, not after a timeout
    message = str(info.value)
    assert "ocdbt.process_1/d/" in message and "does not match its checksum" in message, message
    assert tpudist.checkpoint.latest_step(tmp_path, verify=True) is None
