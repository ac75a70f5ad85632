"""Free TCP ports on this machine (the launcher's for --local, rank 0's host's through its agent)."""

from __future__ import annotations

import socket


def free_ports(count: int = 2) -> list[int]:
    """`count` distinct TCP ports that are free on every interface right now.

    All are bound at once so they differ; another program may still take one before the job does.
    """
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
