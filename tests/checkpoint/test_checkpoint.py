"""tpudist.checkpoint on one process: torch state dicts and JAX pytrees round trip, saves are atomic
(a process killed before the commit leaves the previous step), and bad directories are errors that
name the path and the mismatch, never a partial load.

Each test runs in a fresh tpudist process (the `tpudist` marker), as a training program would.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tpudist
from tpudist import contract
from tpudist.checkpoint import CheckpointError


def _torch_training_state(seed: int):
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.tpudist(nprocs=1)
def test_torch_state_dicts_round_trip(tmp_path):
    import torch
    model, optimizer = _torch_training_state(0)
    half = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)
    tpudist.checkpoint.save(tmp_path, 7, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                          "half": half, "epoch": 3})

    other, other_opt = _torch_training_state(1)  # same architecture, other values
    like = {"model": other.state_dict(), "optimizer": other_opt.state_dict(), "half": torch.zeros(2, 3, dtype=torch.bfloat16),
            "epoch": 0}
    step, state = tpudist.checkpoint.restore(tmp_path, like=like)
    assert step == 7 and state["epoch"] == 3
    assert state["half"].dtype == torch.bfloat16 and torch.equal(state["half"], half)
    other.load_state_dict(state["model"])
    other_opt.load_state_dict(state["optimizer"])
    for name, value in model.state_dict().items():  # weights, BatchNorm statistics, num_batches_tracked
        assert other.state_dict()[name].dtype == value.dtype, name
        assert torch.equal(other.state_dict()[name], value), name
    assert other_opt.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    # The optimizer's moments came back too: one more identical step keeps the two equal.
    batch = torch.randn(16, 4)
    for m, o in ((model, optimizer), (other, other_opt)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


@pytest.mark.tpudist(nprocs=1, cpu_devices=2)
def test_jax_numpy_and_python_leaves_round_trip_with_like_s_shardings(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = tpudist.mesh.make_mesh({"model": 2})
    split = NamedSharding(mesh, P("model"))
    params = {"w": jax.device_put(jnp.arange(12.0).reshape(6, 2), split), "b": jnp.ones(3, jnp.bfloat16)}
    state = {"params": params, "opt": optax.adam(1e-3).init(params), "table": np.arange(5, dtype=np.int64),
             "seen": np.float32(0.25), "step": 41, "lr": 0.1, "warm": True, "name": "run-1"}
    handle = tpudist.checkpoint.save(tmp_path, 41, state, wait=False)
    handle.wait()
    assert handle.done() and tpudist.checkpoint.latest_step(tmp_path) == 41

    replicated = NamedSharding(mesh, P())
    like = jax.tree.map(lambda x: x, state)
    like["params"] = {"w": jax.ShapeDtypeStruct((6, 2), jnp.float32, sharding=replicated),  # another layout
                      "b": jnp.zeros(3, jnp.bfloat16)}
    step, restored = tpudist.checkpoint.restore(tmp_path, like=like)
    assert step == 41
    assert restored["params"]["w"].sharding == replicated  # like's sharding, not the saved one
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(12.0).reshape(6, 2))
    assert restored["params"]["b"].dtype == jnp.bfloat16
    assert type(restored["opt"]) is tuple and type(restored["opt"][0]) is type(state["opt"][0])
    assert isinstance(restored["table"], np.ndarray) and restored["table"].dtype == np.int64
    assert type(restored["seen"]) is np.float32 and restored["seen"] == np.float32(0.25)
    assert (restored["step"], restored["lr"], restored["warm"], restored["name"]) == (41, 0.1, True, "run-1")
    assert type(restored["warm"]) is bool


@pytest.mark.tpudist(nprocs=1)
def test_bad_directories_are_errors_naming_the_path_and_the_mismatch(tmp_path):
    import jax.numpy as jnp
    state = {"w": jnp.arange(4096.0).reshape(64, 64), "b": np.zeros(3, np.float32), "step": 1}
    good = tmp_path / "good"
    tpudist.checkpoint.save(good, 1, state)

    with pytest.raises(FileNotFoundError, match=f"no checkpoint directory {tmp_path / 'missing'}"):
        tpudist.checkpoint.restore(tmp_path / "missing", like=state)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'} holds no committed checkpoint"):
        tpudist.checkpoint.restore(tmp_path / "empty", like=state)
    with pytest.raises(FileNotFoundError, match=r"has no committed step 5; its steps are \[1\]"):
        tpudist.checkpoint.restore(good, like=state, step=5)
    assert tpudist.checkpoint.latest_step(tmp_path / "missing") is None

    # Another model's: each difference is named with its key and both sides.
    cases = [
        ({**state, "w": jnp.zeros((64, 32))}, r"'w' is float32\[64, 64\] in the checkpoint but float32\[64, 32\] in like"),
        ({**state, "b": np.zeros(3, np.int32)}, r"'b' is float32\[3\] in the checkpoint but int32\[3\] in like"),
        ({**state, "extra": np.zeros(2)}, r"like has 'extra' that the checkpoint lacks"),
        ({"w": state["w"], "step": 1}, r"the checkpoint holds 'b' that like lacks"),
        ({**state, "step": np.zeros(2)}, r"'step' is a int64 scalar in the checkpoint but float64\[2\] in like"),
    ]
    for like, message in cases:
        with pytest.raises(ValueError, match=f"{good} step 1 does not match like .*{message}"):
            tpudist.checkpoint.restore(good, like=like)

    # Truncated or missing pieces: CheckpointError naming the path and what is missing.
    def broken(name, damage):
        where = tmp_path / name
        tpudist.checkpoint.save(where, 1, state)
        damage(where / "1" / "default")
        with pytest.raises(CheckpointError, match=f"{where} step 1") as info:
            tpudist.checkpoint.restore(where, like=state)
        return str(info.value)

    def truncate_largest(item):
        data = max(glob.glob(str(item / "ocdbt.process_0" / "d" / "*")), key=os.path.getsize)
        os.truncate(data, os.path.getsize(data) // 2)

    assert "is truncated" in broken("truncated", truncate_largest)
    assert "_METADATA is missing" in broken("no_metadata", lambda item: os.remove(item / "_METADATA"))
    assert "is missing" in broken("no_data", lambda item: [os.remove(f) for f in glob.glob(str(item / "d" / "*"))])
    assert "is not a checkpoint that tpudist.checkpoint.save wrote" in broken(
        "not_ours", lambda item: os.rename(item, item.parent / "other"))

    with pytest.raises(ValueError, match=f"{good} already has step 1; save a later step"):
        tpudist.checkpoint.save(good, 1, state)
    with pytest.raises(TypeError, match=r"state\['bad'\]: cannot checkpoint a object"):
        tpudist.checkpoint.save(good, 2, {**state, "bad": object()})
    assert tpudist.checkpoint.latest_step(good) == 1


# -- atomicity: a process killed after writing, before the commit -----------------------------------

_KILLED_MID_SAVE = """
import asyncio, pathlib, sys
import numpy as np, tpudist
from orbax.checkpoint._src.path import async_path
directory, marker = sys.argv[1], pathlib.Path(sys.argv[2])
tpudist.checkpoint.save(directory, 1, {"w": np.full(1000, 1.0), "step": 1})

async def stall_at_the_commit(src, dst):  # every file is written; the rename would commit step 2
    marker.write_text(str(src))
    await asyncio.sleep(3600)

async_path.rename = stall_at_the_commit
tpudist.checkpoint.save(directory, 2, {"w": np.full(1000, 2.0), "step": 2})
"""


def _read(directory):
    state = {"w": np.zeros(1000), "step": 0}
    return tpudist.checkpoint.latest_step(directory), tpudist.checkpoint.restore(directory, like=state)


def test_a_save_killed_before_its_commit_leaves_the_previous_step(tmp_path):
    from tpudist.testing import run_on_mesh
    directory, marker = tmp_path / "ckpt", tmp_path / "writing"
    env = {k: v for k, v in os.environ.items() if k not in contract.ALL}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_SAVE, str(directory), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the save never reached its commit (exit code {child.poll()})"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert glob.glob(str(directory / "2.orbax-checkpoint-tmp*")), os.listdir(directory)  # written, not committed

    [(latest, (step, state))] = run_on_mesh(_read, nprocs=1, kwargs={"directory": directory})
    assert latest == 1 and step == 1
    np.testing.assert_array_equal(state["w"], np.full(1000, 1.0))
    assert state["step"] == 1
    # The interrupted step can be written again; the next save's manager clears what was left.
    [(latest, (step, state))] = run_on_mesh(_save_again_then_read, nprocs=1, kwargs={"directory": directory})
    assert latest == step == 2 and state["step"] == 2
    assert not glob.glob(str(directory / "*.orbax-checkpoint-tmp*"))


def _save_again_then_read(directory):
    tpudist.checkpoint.save(directory, 2, {"w": np.full(1000, 2.0), "step": 2})
    return _read(directory)
