"""Helpers for the launcher's tests: run the launcher, find a job's processes by a marker.

`launch(...)` runs `python -m tpudist.xla_dist` as a real subprocess. A test puts a unique `marker`
in its job's argv so `pids_with(marker)` finds the job's processes on every (loopback) host.
"""

from __future__ import annotations

import os
import pathlib
import re
import select
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def launcher_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tpudist.xla_dist", *args]


def launch(*args: str, timeout: float = 90, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Runs the launcher to completion; stdout and stderr captured as bytes."""
    return subprocess.run(launcher_argv(*args), cwd=ROOT, capture_output=True, timeout=timeout,
                          env=env, **kw)


def launch_on_terminal(*args: str, timeout: float = 90, env: dict | None = None) -> tuple[int, bytes]:
    """Runs the launcher to completion with a pseudo-terminal as its stdout and stderr, as from a
    user's shell; returns its exit status and all it wrote there, less the terminal's control
    sequences (the live status's cursor moves) and carriage returns."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(launcher_argv(*args), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave,
                                stderr=slave, env=env, start_new_session=True)
    finally:
        os.close(slave)
    out = bytearray()
    end = time.monotonic() + timeout
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait(timeout=10)
                raise AssertionError(f"the launcher ran past {timeout} s; its terminal so far: {bytes(out)!r}")
            if select.select([master], [], [], min(left, 1.0))[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the launcher, the terminal's last writer, has closed it
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(master)
    return proc.wait(timeout=10), re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]|\r", b"", bytes(out))


def start_launcher(*args: str, env: dict | None = None) -> subprocess.Popen:
    """The launcher in its own session (a signal to it does not reach pytest)."""
    # Unbuffered, so select() in wait_lines sees every line that has not been read yet.
    return subprocess.Popen(launcher_argv(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True, bufsize=0)


def pids_with(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (on this machine: every loopback host)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def family(root: int) -> list[int]:
    """`root`'s descendants now (from /proc, independent of tpudist's own process walk)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = stat[0]
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    return [pid for pid in pids if (stat := _stat(pid)) is not None and stat[1] != "Z"]


def describe(pids: list[int]) -> str:
    """Each process with its state and its parent's, for a failure message: who kept it alive."""
    def one(pid: int) -> str:
        stat = _stat(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            stat = None
        return f"{pid} (gone)" if stat is None else f"{pid} {stat[1]} ppid {stat[0]} [{argv[:120]}]"

    lines = []
    for pid in pids:
        lines.append(one(pid))
        if (stat := _stat(pid)) is not None:
            lines.append("  parent " + one(stat[0]))
    return "\n".join(lines)


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_lines(proc: subprocess.Popen, count: int, needle: bytes, timeout: float) -> list[bytes]:
    """Reads the launcher's stdout until `count` lines contain `needle`."""
    lines: list[bytes] = []
    end = time.monotonic() + timeout
    while sum(needle in line for line in lines) < count:
        ready = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))[0]
        if not ready:
            raise AssertionError(f"only {sum(needle in x for x in lines)}/{count} lines with {needle!r}: {lines}")
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"launcher exited early ({proc.wait()}): {proc.stderr.read().decode()}")
        lines.append(line)
    return lines


def job_pids(marker: str) -> list[int]:
    """Live processes whose argv or environment carries `marker` (every loopback host is here)."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in argv or needle in environ:
            found.append(int(entry))
    return found


def environ_of(pid: int) -> dict[bytes, bytes]:
    """A live process's environment ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return {}


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])
