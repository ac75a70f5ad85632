"""The agent's side of hang reports: each process's private directory, its stacks and progress, and
whether the kernel's OOM killer ran while it ran.

Each process gets `<root>/rank<R>` in TPUDIST_DEBUG_DIR (emptied before it starts, so a restarted
rank is never signalled before its own `tpudist.init()` put its dumper in place). On the launcher's
Stacks request, `collect` signals every process whose dumper is ready, all at once, waits until
each one's dump has stopped growing, and returns one `RankStacks` per running process, with a
reason where there is no dump (no Python of the rank installed the dumper, the process is stopped).

    root = make_root()                       # the agent's directory, removed by remove_root(root)
    progress_total([proc_dir(root, 0)])      # eager collectives entered so far, for the heartbeat
    collect([(0, popen.pid, proc_dir(root, 0))], deadline_s=3.0)
"""

from __future__ import annotations

import os
import tempfile
import time

import tpudist._stacks as _stacks
from tpudist.launch.control import control_pb2 as pb

_STEADY_S = 0.1  # a dump that has not grown for this long is complete
_POLL_S = 0.02


def make_root() -> str:
    return tempfile.mkdtemp(prefix="tpudist-agent-")  # 0700: the dumps are this user's alone


def proc_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"rank{rank}")


def clear(directory: str) -> None:
    """An empty directory for a process about to start (a previous attempt's files removed)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in os.listdir(directory):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def remove_root(root: str) -> None:
    try:
        for rank_dir in os.listdir(root):
            clear(os.path.join(root, rank_dir))
            os.rmdir(os.path.join(root, rank_dir))
        os.rmdir(root)
    except OSError:
        pass


def progress_total(directories: list[str]) -> int:
    """Eager collectives entered by these processes so far."""
    return sum(p.collectives for d in directories if (p := _stacks.read_progress(d)) is not None)


_NO_DUMPER = ("no stack dumper: no Python of this rank has started (yet), or it cannot show its stacks "
              "(`python -S`/`-I`, TPUDIST_STARTUP_HOOK=0 without tpudist.init(), or tpudist not "
              "importable by its interpreter)")


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is a descendant of `ancestor` (a few generations at most)."""
    for _ in range(8):
        pid = _parent(pid)
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def collect(procs: list[tuple[int, int, str]], deadline_s: float = 3.0) -> list[pb.RankStacks]:
    """Every process's stacks: `procs` are (rank, pid, directory) of the running ones."""
    out, waiting = [], []
    for rank, pid, directory in procs:
        rs = pb.RankStacks(rank=rank, pid=pid, state=_state(pid))
        progress = _stacks.read_progress(directory)
        if progress is not None and progress.collectives:
            rs.collective, rs.collectives = progress.name, progress.collectives
            rs.collective_age_s = max(0.0, time.monotonic() - progress.entered_at)
        ready = _stacks.read_ready(directory)
        path = os.path.join(directory, _stacks.STACKS_FILE)
        if ready is not None and ready[0] != pid and _descends(ready[0], pid):
            pid = rs.pid = ready[0]  # a wrapper's (sh, bash) Python child: its stacks are the rank's
            rs.state = _state(pid)
        if ready is None or ready[0] != pid:
            rs.error = _NO_DUMPER
        elif rs.state in ("T", "t"):
            rs.error = "the process is stopped (SIGSTOP or a debugger): it cannot dump its stacks"
        else:
            rs.main_thread = ready[1]
            try:
                os.truncate(path, 0)  # the runtime appends (O_APPEND): the next dump starts at 0
                os.kill(pid, _stacks.STACKS_SIGNAL)
                waiting.append((rs, path))
            except OSError as e:
                rs.error = f"cannot ask it for its stacks: {e.strerror}"
        out.append(rs)
    _await_dumps(waiting, deadline_s)
    return out


def _await_dumps(waiting: list[tuple[pb.RankStacks, str]], deadline_s: float) -> None:
    """Reads each dump once it has stopped growing (faulthandler writes it from the signal handler)."""
    end = time.monotonic() + deadline_s
    sizes = {path: (-1, 0.0) for _, path in waiting}
    pending = list(waiting)
    while pending:
        now = time.monotonic()
        for rs, path in list(pending):
            try:
                size = os.path.getsize(path)
            except OSError:
                size = 0
            last, since = sizes[path]
            if size != last:
                sizes[path] = (size, now)
            elif size > 0 and now - since >= _STEADY_S:
                with open(path, "rb") as f:
                    rs.dump = f.read()
                pending.remove((rs, path))
        if now >= end:
            for rs, _ in pending:
                why = "in uninterruptible I/O" if rs.state == "D" else "its signal handler did not run"
                rs.error = f"no stacks within {deadline_s:g} s (state {rs.state}: {why})"
            return
        time.sleep(_POLL_S)


def oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer ended (/proc/vmstat oom_kill), None if unknown."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def sigkill_note(before: int | None) -> bytes:
    """What the failure table says under a process that SIGKILL ended, when the kernel counted an
    OOM kill while it ran ("" otherwise)."""
    after = oom_kills()
    if before is not None and after is not None and after > before:
        return (f"tpudist agent: the kernel's OOM killer ended {after - before} process(es) on this "
                f"host while this one ran (/proc/vmstat oom_kill {before} -> {after}): it most likely ran "
                "out of memory").encode()
    return b""
