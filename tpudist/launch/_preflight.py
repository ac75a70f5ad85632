"""The launcher's side of the TPU preflight: which paths every agent checks, and what its answers mean.

Each host's agent checks its TPU before it registers (`agent/_tpucheck.py`) and reports a
`TpuCheck`; once every host has registered, `refusal` turns any problem into one message naming
the host, the PID and command line (or the stale lock file) and the command that fixes it, and
the supervisor starts nothing. `--skip-preflight` sends no paths, so no agent checks.

    devices, lockfile = preflight_paths(config)            # into each agent's bootstrap line
    message = refusal({w: r.tpu for w, r in registered.items()}, cluster.hosts)

A pinned `--coordinator-port` of a multi-host job is checked before any host is touched
(`coordinator_port_refusal`): a second coordinator on a port where one listens would take the first
job's processes (gRPC binds with SO_REUSEPORT), so the second job starts nothing instead.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import tpudist.contract as contract
from tpudist.launch.agent._tpucheck import describe
from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.config import LaunchConfig


def preflight_paths(config: LaunchConfig) -> tuple[str, str]:
    """The device node globs and lock file every agent checks: --env, else this environment, else
    the defaults; ("", "") with --skip-preflight."""
    if config.job.skip_preflight:
        return "", ""
    env = {**os.environ, **config.procs.env}
    return (env.get(contract.TPU_DEVICES) or contract.DEFAULT_TPU_DEVICES,
            env.get(contract.LIBTPU_LOCKFILE) or contract.DEFAULT_LIBTPU_LOCKFILE)


def refusal(checks: Mapping[int, object], hosts: Sequence[Host]) -> str | None:
    """None when every host's TPU is free; else why the job does not start, host by host."""
    lines = [f"  host {hosts[w]}: {describe(p)}" for w, c in sorted(checks.items()) for p in c.problems]
    if not lines:
        return None
    busy = sum(1 for c in checks.values() if c.problems)
    return (f"the TPU of {busy} of {len(hosts)} hosts is not free, so nothing was started:\n"
            + "\n".join(lines) + "\nRun the fix on each host, or pass --skip-preflight to start anyway.")


PORT_PROBE_S = 1.0


def coordinator_port_refusal(config: LaunchConfig, cluster: Cluster) -> str | None:
    """None unless --coordinator-port is pinned, the job spans hosts (a one-host job's coordinator
    is a Unix socket) and something already accepts connections there on rank 0's host.

    An address this machine cannot reach (a TPU's internal IP from outside its network) passes:
    rank 0 then finds the port taken itself, before starting its coordinator (tpudist/_coordinator.py).
    """
    port = config.job.coordinator_port
    if not port or len(cluster.hosts) == 1:
        return None
    from tpudist.launch._transport import reach_address

    addr = reach_address(cluster, config.ssh)
    try:
        with socket.create_connection((addr, port), timeout=PORT_PROBE_S):
            pass
    except OSError:  # refused: free; no answer: unknown from here
        return None
    host = "" if str(cluster.hosts[0]) == addr else f" (rank 0's host {cluster.hosts[0]})"
    return (f"--coordinator-port {port} is in use on {addr}{host}: another "
            "job's JAX coordinator or another program listens there, and this job's processes would "
            "reach it instead of their own, so nothing was started. Pass another --coordinator-port, "
            "or none to use a free one.")
