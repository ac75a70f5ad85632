"""The pod launcher: `python -m tpudist.xla_dist` (or `tpudist launch`).

    python -m tpudist.xla_dist --hosts 10.0.0.2,10.0.0.3 --nproc-per-host 2 -- python train.py
    python -m tpudist.xla_dist --tpu=$TPU_NAME --conda-env=torch-xla --env K=V -- python train.py

`parse_args` turns the command line into a frozen `LaunchConfig`; a cluster source resolves the
hosts (`ClusterSource`: local, --hosts, --hostfile, --tpu, SLURM; `clusters/`), `build_plan` gives
every process its argv and environment, and the `Supervisor` starts one agent per host over SSH
(`agent/`), runs the job through the gRPC control plane (`control/`), feeds what happens to the
job's state machine (`Attempt`) and stops everything on the first failure. See docs/launcher.md.

Importing this package is cheap: nothing is imported until used (see below).
"""

from __future__ import annotations

import importlib
from typing import Any

# Everything is imported on first use: every host's agent imports this package (for
# `python -m tpudist.launch.agent`), and each import here would add to every agent's start-up.
# The cluster sources register themselves when `sources.sources()` is first asked for them.
_LAZY = {
    "LaunchConfig": "tpudist.launch.config", "ClusterOptions": "tpudist.launch.config",
    "ProcessOptions": "tpudist.launch.config", "SshOptions": "tpudist.launch.config",
    "JobOptions": "tpudist.launch.config", "OutputOptions": "tpudist.launch.config",
    "main": "tpudist.xla_dist", "build_parser": "tpudist.launch.args", "parse_args": "tpudist.launch.args",
    "Cluster": "tpudist.launch.clusters", "ClusterSource": "tpudist.launch.clusters",
    "Host": "tpudist.launch.clusters", "Verdict": "tpudist.launch.clusters",
    "resolve_cluster": "tpudist.launch.clusters", "sources": "tpudist.launch.clusters",
    "verdicts": "tpudist.launch.clusters",
    "ProcessPlan": "tpudist.launch.plan", "build_plan": "tpudist.launch.plan",
    "plan_json": "tpudist.launch.plan",
    "Attempt": "tpudist.launch.attempt", "AttemptResult": "tpudist.launch.attempt",
    "Outcome": "tpudist.launch.attempt",
    "Supervisor": "tpudist.launch.supervisor", "LaunchError": "tpudist.launch._startup",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpudist.launch' has no attribute {name!r}")
