"""tpudist.spawn: results, failure propagation, and nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tpudist


def report(index: int, scale: float) -> tuple:
    import jax
    return (index * scale, tpudist.process_index(), tpudist.process_count(),
            tpudist.local_process_index(), len(jax.devices()), len(jax.local_devices()))


def test_spawn_returns_every_result_in_index_order():
    results = tpudist.spawn(report, args=(2.0,), nprocs=2, cpu_devices=2, timeout=120)
    assert results == [(0.0, 0, 2, 0, 4, 2), (2.0, 1, 2, 1, 4, 2)]


def fail_on_one(index: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, str(index)), "w") as f:
        f.write(str(os.getpid()))
    if index == 1:
        time.sleep(0.5)
        raise ValueError(f"bad value on {index}")
    time.sleep(120)  # must be stopped by spawn, not waited for


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split()[2] != "Z"


def test_failure_stops_the_others_and_raises_with_index_and_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(tpudist.SpawnError) as info:
        tpudist.spawn(fail_on_one, args=(str(tmp_path),), nprocs=3, init=False, timeout=120)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.index == 1 and err.exitcode == 1
    assert "ValueError: bad value on 1" in str(err) and "fail_on_one" in str(err)
    pids = [int((tmp_path / str(i)).read_text()) for i in range(3)]
    assert not any(_alive(p) for p in pids)


def killed(index: int) -> None:
    if index == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def test_a_process_killed_by_a_signal_is_reported():
    with pytest.raises(tpudist.SpawnError, match="process 0 .*killed by SIGKILL"):
        tpudist.spawn(killed, nprocs=2, init=False, timeout=120)


def sleeper(index: int) -> None:
    time.sleep(120)


def test_timeout_stops_everything():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"processes \[0, 1\] still running after 2s"):
        tpudist.spawn(sleeper, nprocs=2, init=False, timeout=2)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("kwargs, words", [
    ({"nprocs": 0}, "nprocs=0"), ({"nprocs": 2, "cpu_devices": 0}, "cpu_devices=0")])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        tpudist.spawn(sleeper, **kwargs)


_ORPHAN_SCRIPT = """
import os, subprocess, sys, time, tpudist
def child(index, pid_dir):
    grandchild = subprocess.Popen(["sleep", "300"])   # something the child started, too
    for pid in (os.getpid(), grandchild.pid):
        open(os.path.join(pid_dir, str(pid)), "w").close()
    time.sleep(300)
if __name__ == "__main__":
    tpudist.spawn(child, args=(sys.argv[1],), nprocs=2, init=False)
"""


def test_children_die_with_a_killed_parent(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_dir)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(os.listdir(pid_dir)) < 4:
        time.sleep(0.2)
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert len(pids) == 4, "spawned children did not start"
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


def reduce_value(index: int) -> float:
    return float(tpudist.all_reduce(np.float32(index + 1)))


def test_spawned_processes_share_one_job():
    assert tpudist.spawn(reduce_value, nprocs=2, cpu_devices=1, timeout=120) == [3.0, 3.0]


def malloc_huge_pages(index: int) -> tuple:
    """Touches a 64 MiB glibc allocation (as XLA:CPU makes for a 64 MiB output) and reports the
    environment's tunables and how much of this process's memory sits in huge pages."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    ptr = libc.malloc(size)
    ctypes.memset(ptr, 1, size)
    with open("/proc/self/smaps_rollup") as f:
        huge_kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    libc.free(ctypes.c_void_p(ptr))
    return os.environ.get("GLIBC_TUNABLES"), huge_kb


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_spawned_processes_get_huge_pages_for_large_allocations(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("TPUDIST_HUGEPAGES", raising=False)
    results = tpudist.spawn(malloc_huge_pages, nprocs=2, init=False, timeout=60)
    assert [tunables for tunables, _ in results] == ["glibc.malloc.hugetlb=1"] * 2
    if _thp_mode() in ("madvise", "always"):
        assert all(huge_kb >= 32 << 10 for _, huge_kb in results), results
    assert "GLIBC_TUNABLES" not in os.environ  # the parent's environment is left as it was
    opted_out = tpudist.spawn(malloc_huge_pages, nprocs=1, init=False, timeout=60, env={"TPUDIST_HUGEPAGES": "0"})
    assert opted_out[0][0] is None
    if _thp_mode() == "madvise":
        assert opted_out[0][1] < 32 << 10


def start_daemon(index: int, pid_dir: str, fail: bool) -> int:
    """Leaves a daemon behind (fork, setsid, fork: its own session, its parent gone), then returns."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            # Written then renamed: the parent waits for the name, so it must never see an empty file.
            tmp = os.path.join(pid_dir, f".{index}.tmp")
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.rename(tmp, os.path.join(pid_dir, str(index)))
            time.sleep(120)
        os._exit(0)
    os.waitpid(child, 0)
    while not os.path.exists(os.path.join(pid_dir, str(index))):
        time.sleep(0.01)
    if fail and index == 1:
        while not os.path.exists(os.path.join(pid_dir, "0")):  # (the other's daemon up too: the failure ends both)
            time.sleep(0.01)
        raise RuntimeError("failed after starting a daemon")
    return index


@pytest.mark.parametrize("fail", [False, True])
def test_no_daemon_a_spawned_process_started_outlives_it(tmp_path, fail):
    if fail:
        with pytest.raises(tpudist.SpawnError):
            tpudist.spawn(start_daemon, args=(str(tmp_path), True), nprocs=2, init=False, timeout=60)
    else:
        assert tpudist.spawn(start_daemon, args=(str(tmp_path), False), nprocs=2, init=False,
                             timeout=60) == [0, 1]
    daemons = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(daemons) == 2
    deadline = time.monotonic() + 2.0
    while any(_alive(p) for p in daemons) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in daemons), "a daemon outlived tpudist.spawn"
