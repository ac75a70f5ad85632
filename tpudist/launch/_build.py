"""The steps `python -m tpudist.xla_dist` takes before supervising: build the cluster, or a dry run.

    config = parse_args(["--hosts", "a,b", "--", "python", "train.py"])
    cluster = build(config)         # resolves the hosts and checks the whole plan once
    dry_run(config, cluster)        # prints {"processes": [...]} and starts nothing
"""

from __future__ import annotations

import sys

import tpudist._proc as _proc
from tpudist.launch._preflight import coordinator_port_refusal
from tpudist.launch.config import LaunchConfig
from tpudist.launch.plan import Ports, build_plan, choose_ports, console_is_terminal, plan_json
from tpudist.launch.clusters import Cluster, choose_cluster, verdicts


def build(config: LaunchConfig) -> Cluster:
    """Resolves the cluster and builds the plan once, so bad input fails before any host is touched."""
    verbose = config.output.verbose
    if verbose:
        for name, verdict in verdicts(config.cluster):
            print(f"tpudist: source {name}: {'yes' if verdict.applies else 'no'}: {verdict.reason}",
                  file=sys.stderr)
    cluster = choose_cluster(config.cluster)
    plan = build_plan(config.procs, cluster, Ports(1, 2), job_id="check")
    if not config.job.dry_run and (busy := coordinator_port_refusal(config, cluster)):
        raise ValueError(busy)
    if config.job.coordinator_port and len(cluster.hosts) == 1:
        print(f"tpudist: --coordinator-port {config.job.coordinator_port} is not used: a one-host job's JAX "
              "coordinator is a Unix socket only your user can open (docs/launcher.md)", file=sys.stderr)
    if config.job.min_hosts is not None:
        _check_elastic(config.job.min_hosts, cluster)
    ranks = config.output.ranks
    if ranks and max(ranks) >= len(plan):
        raise ValueError(f"--ranks-filter {config.output.ranks_text}: the job has ranks 0..{len(plan) - 1}")
    if verbose:
        slices = f" in {cluster.num_slices} slices" if cluster.num_slices > 1 else ""
        print(f"tpudist: {cluster.source}: {len(cluster.hosts)} hosts{slices}, {len(plan)} processes",
              file=sys.stderr)
    return cluster


def _check_elastic(min_hosts: int, cluster: Cluster) -> None:
    """--min-hosts needs hosts that can run without each other: not a TPU slice's workers."""
    if min_hosts > len(cluster.hosts):
        raise ValueError(f"--min-hosts {min_hosts} is more than the job's {len(cluster.hosts)} hosts")
    if cluster.accelerator_type or cluster.num_slices > 1:
        raise ValueError(f"--min-hosts cannot drop a host of a TPU slice ({cluster.accelerator_type or 'multislice'}"
                         f" from {cluster.source}): the slice's chips work only with every one of its hosts. "
                         "It works on clusters of independent hosts (--hosts, --hostfile, Slurm); on a TPU, "
                         "restart on a new slice with --max-restarts and fit's checkpoint_dir")


def dry_run(config: LaunchConfig, cluster: Cluster) -> int:
    """Prints the plan as JSON. Automatic ports are probed here; at start they are probed on rank 0's host."""
    from tpudist.launch._transport import reach_address

    plan = build_plan(config.procs, cluster, choose_ports(config.job, _proc.free_ports(2)), job_id="dry-run",
                      coordinator=reach_address(cluster, config.ssh), stop_grace=config.job.stop_grace,
                      console=console_is_terminal(config.output.quiet))
    sys.stdout.buffer.write(plan_json(plan).encode("utf-8", "surrogateescape") + b"\n")
    sys.stdout.flush()
    return 0
