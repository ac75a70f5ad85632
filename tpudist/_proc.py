"""Process helpers shared by the launcher's agent and `tpudist.spawn`: free ports, the death signal.

Both start processes on this machine and must not leave them behind; both need free TCP ports for
a job's coordinator. Standard library only: the agent imports this on every host's start-up.

    coordinator, master = free_ports(2, "127.0.0.1")
    set_parent_death_signal(signal.SIGTERM)   # Linux: SIGTERM when the parent process dies
"""

from __future__ import annotations

import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1


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
