"""tpudist.checkpoint checks what it reads: a byte changed in any file of a committed step is a
CheckpointError naming the file (orbax alone would load the wrong values), `latest_step(verify=True)`
skips such a step, a truncated tree metadata file is named as such, and a save that fails on a full
disk removes what it wrote, so the next save has the space again.

Each test runs in a fresh tpudist process (the `tpudist` marker), as a training program would.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import tpudist
from tpudist.checkpoint import CheckpointError

N = 100_000


def _state(value: float):
    return {"w": np.full(N, value, np.float32) + np.arange(N, dtype=np.float32), "step": int(value)}


def _like():
    return {"w": np.zeros(N, np.float32), "step": 0}


def _files(step_dir):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.tpudist(nprocs=1)
def test_a_flipped_byte_in_an_array_file_is_an_error_naming_the_file(tmp_path):
    tpudist.checkpoint.save(tmp_path, 1, _state(1))
    tpudist.checkpoint.save(tmp_path, 2, _state(2))
    item = tmp_path / "2" / "default"
    data = max(_files(item / "ocdbt.process_0"), key=os.path.getsize)
    size = os.path.getsize(data)
    for offset in np.linspace(0, size - 1, 14).astype(int):  # bit rot anywhere in the file
        _flip(data, offset)
        with pytest.raises(CheckpointError) as info:
            tpudist.checkpoint.restore(tmp_path, like=_like())
        message = str(info.value)
        assert f"{tmp_path} step 2 is incomplete or corrupt: {data} does not match its checksum" in message
        assert "Nothing was loaded" in message and "verify=True" in message, message
        _flip(data, offset)  # back as written: the step reads again
        step, state = tpudist.checkpoint.restore(tmp_path, like=_like())
        assert step == 2 and np.array_equal(state["w"], _state(2)["w"])

    _flip(data, size // 2)
    assert tpudist.checkpoint.latest_step(tmp_path) == 2  # the name alone: as before
    assert tpudist.checkpoint.latest_step(tmp_path, verify=True) == 1
    step, state = tpudist.checkpoint.restore(tmp_path, like=_like(), step=1)
    assert step == 1 and np.array_equal(state["w"], _state(1)["w"]) and state["step"] == 1

    # Any file of the step is covered, the small OCDBT and metadata files too.
    manifest = json.loads((item / "_CHECKSUMS").read_text())["files"]
    covered = {os.path.join(item, n) for n in manifest}
    assert {f for f in _files(item) if not f.endswith(("_CHECKSUMS", "commit_success.txt"))} <= covered


@pytest.mark.tpudist(nprocs=1)
def test_a_truncated_metadata_file_is_named_as_truncated(tmp_path):
    for name, checksums in (("verified", True), ("older", False)):
        where = tmp_path / name
        tpudist.checkpoint.save(where, 1, _state(1))
        item = where / "1" / "default"
        if not checksums:  # a step from orbax directly or an older tpudist: no _CHECKSUMS
            os.remove(item / "_CHECKSUMS")
        metadata = item / "_METADATA"
        full = metadata.read_bytes()
        for cut in range(1, len(full), max(1, len(full) // 12)):
            metadata.write_bytes(full[:cut])
            with pytest.raises(CheckpointError) as info:
                tpudist.checkpoint.restore(where, like=_like())
            message = str(info.value)
            assert f"{where} step 1" in message and str(metadata) in message, message
            assert "truncated" in message, message
        metadata.write_bytes(full)
        assert tpudist.checkpoint.restore(where, like=_like())[0] == 1


def _mount_tmpfs(where, size: str) -> None:
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small tmpfs to fill ({e}); needs root")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({done.stderr.strip()}); needs root")


@pytest.mark.tpudist(nprocs=1)
def test_a_save_that_fills_the_disk_removes_its_files_and_later_saves_work(tmp_path):
    """A real 4 MiB file system, filled by a save of 5 MiB (random floats: zstd cannot shrink them)."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "4m")
    try:
        rng = np.random.default_rng(0)
        small = {"w": rng.random(250_000).astype(np.float32)}  # 1 MB
        big = {"a": rng.random(650_000).astype(np.float32), "b": rng.random(650_000).astype(np.float32)}
        directory = disk / "ckpt"
        tpudist.checkpoint.save(directory, 1, small)
        with pytest.raises(CheckpointError) as info:
            tpudist.checkpoint.save(directory, 2, big)
        assert sorted(os.listdir(directory)) == ["1"]  # no 2.orbax-checkpoint-tmp holding the space
        assert "saving step 2 to" in str(info.value) and "No space left on device" in str(info.value)
        assert "removed its temporary directory 2.orbax-checkpoint-tmp" in str(info.value)
        tpudist.checkpoint.save(directory, 3, small)  # the space is back
        handle = tpudist.checkpoint.save(directory, 4, small, wait=False)
        handle.wait()
        assert sorted(os.listdir(directory)) == ["1", "3", "4"]
        assert tpudist.checkpoint.latest_step(directory, verify=True) == 4
        step, state = tpudist.checkpoint.restore(directory, like={"w": np.zeros(250_000, np.float32)})
        assert step == 4 and np.array_equal(state["w"], small["w"])
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


class _DiskFull:
    """A stand-in for one host's disk filling up under its writes (one process of a shared
    directory cannot be given a disk of its own here): the write's future fails as TensorStore's
    does on ENOSPC."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device")


@pytest.mark.tpudist(nprocs=2, cpu_devices=1)
def test_a_save_that_fails_on_one_process_fails_on_every_process_within_seconds(tmp_path):
    import time

    import orbax.checkpoint as ocp

    rank = tpudist.process_index()
    directory = str(tmp_path / "ckpt")  # the same path on both ranks
    tpudist.checkpoint.save(directory, 1, _state(1.0))
    original = ocp.PyTreeCheckpointHandler.async_save
    if rank == 1:
        async def failing(self, *args, **kwargs):
            await original(self, *args, **kwargs)
            return [_DiskFull()]
        ocp.PyTreeCheckpointHandler.async_save = failing
    start = time.monotonic()
    try:
        with pytest.raises(CheckpointError) as info:
            tpudist.checkpoint.save(directory, 2, _state(2.0))
    finally:
        ocp.PyTreeCheckpointHandler.async_save = original
    took = time.monotonic() - start
    message = str(info.value)
    assert "saving step 2 to" in message and "No space left on device" in message, message
    if rank == 0:  # the process that wrote fine names the one that failed, at once, not after 1,200 s
        assert "rank 1 on" in message and "could not write its part" in message, message
    assert took < 20, (took, message)
    tpudist.checkpoint.save(directory, 3, _state(3.0))  # the next save works on both
    assert tpudist.checkpoint.latest_step(directory, verify=True) == 3
