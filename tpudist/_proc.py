"""Process helpers shared by the launcher's agent and `tpudist.spawn`: ports, death signal, descendants.

Both start processes on this machine and must not leave any behind, not even one that left its
process group or session (a daemon: fork, `setsid`, fork): each becomes a child subreaper
(PR_SET_CHILD_SUBREAPER), so orphans of its descendants are re-parented to it instead of PID 1,
and stops every descendant it has, found through /proc, with SIGTERM, a grace period, SIGKILL.
Both need free TCP ports for a job's coordinator. Standard library only: every host's agent
imports this at start-up.

    coordinator, master = free_ports(2, "127.0.0.1")
    set_parent_death_signal(signal.SIGTERM)   # Linux: SIGTERM when the parent process dies
    become_subreaper()
    stop_descendants(os.getpid(), grace_s=3.0)  # SIGTERM, up to 3 s, SIGKILL; reaps orphans
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.02


def free_ports(count: int = 2, host: str = "") -> list[int]:
    """`count` distinct TCP ports that are free on `host` ("": every interface) right now.

    All are bound at once so they differ; another program may still take one before the job does.
    """
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that was free on `host` a moment ago."""
    return free_ports(1, host)[0]


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: only the processes that ask pay for it

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Asks Linux to send `signum` to this process when its parent dies (PR_SET_PDEATHSIG).

    The request is tied to the parent *thread*: a parent that started this process from a thread
    that then ends sends it too. Returns False where it is not available (then stdin EOF, a
    watchdog or keepalive must notice the parent's end)."""
    return _prctl(_PR_SET_PDEATHSIG, int(signum))


def become_subreaper() -> bool:
    """Makes this process the reaper of its descendants' orphans (Linux 3.4+); False elsewhere."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every process on this machine: pid -> (parent pid, process group, state letter), from /proc."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it just ended
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (command)", which may hold spaces
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Live (not zombie) descendants of `root`, parents before their children."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if table[pid][2] != "Z":
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def send(pids: Iterable[int], signum: int) -> None:
    """`signum` to each pid; one that has already ended is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap_orphans(keep: Iterable[int] = ()) -> None:
    """Collects the exit status of this process's children that ended, except those in `keep`
    (children whose owner waits for them itself, such as a subprocess.Popen's)."""
    keep = set(keep)
    me = os.getpid()
    for pid, (ppid, _, state) in process_table().items():
        if ppid == me and state == "Z" and pid not in keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def stop_descendants(root: int, grace_s: float, keep: Iterable[int] = ()) -> list[int]:
    """SIGTERM to every descendant of `root`, up to `grace_s` for them to end, then SIGKILL, repeated
    for any started meanwhile; orphans re-parented to this process are reaped (never those in
    `keep`). Returns the pids still alive at the end (normally none)."""
    keep = set(keep)
    targets = descendants(root)
    send(targets, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while targets and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        reap_orphans(keep)
        targets = descendants(root)
    end = time.monotonic() + 2.0
    while targets and time.monotonic() < end:
        send(targets, signal.SIGKILL)
        time.sleep(_POLL_S)
        reap_orphans(keep)
        targets = descendants(root)
    return targets
