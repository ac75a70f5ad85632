"""The steps `python -m tpudist.xla_dist` takes before supervising: parse, build, dry run.

    args = parse(["--hosts", "a,b", "--", "python", "train.py"])
    cluster = build(args)           # resolves the hosts and checks the whole plan once
    dry_run(args, cluster)          # prints {"processes": [...]} and starts nothing
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tpudist.launch import _cluster, sources_basic
from tpudist.launch.args import parse_args
from tpudist.launch._ports import free_ports
from tpudist.launch.plan import Ports, build_plan, choose_ports, plan_json


def parse(argv: Sequence[str], prog: str) -> argparse.Namespace:
    """The checked command line; argparse's own errors exit with status 2."""
    _cluster._load_sources()  # every cluster source registered before its flags are read
    return parse_args(argv, prog)


def choose_cluster(args: argparse.Namespace) -> _cluster.Cluster:
    """An explicit --local wins; otherwise the first source that applies (local when none does)."""
    if args.verbose:
        for name, verdict in _cluster.verdicts(args):
            print(f"tpudist: source {name}: {'yes' if verdict.applies else 'no'}: {verdict.reason}",
                  file=sys.stderr)
    if args.local:
        return sources_basic.LocalSource.resolve(args)
    return _cluster.resolve_cluster(args)


def build(args: argparse.Namespace) -> _cluster.Cluster:
    """Resolves the cluster and builds the plan once, so bad input fails before any host is touched."""
    cluster = choose_cluster(args)
    plan = build_plan(args, cluster, Ports(1, 2), job_id="check")
    if args.ranks and max(args.ranks) >= len(plan):
        raise ValueError(f"--ranks-filter {args.ranks_filter}: the job has ranks 0..{len(plan) - 1}")
    if args.verbose:
        print(f"tpudist: {cluster.source}: {len(cluster.hosts)} hosts, {len(plan)} processes", file=sys.stderr)
    return cluster


def dry_run(args: argparse.Namespace, cluster: _cluster.Cluster) -> int:
    """Prints the plan as JSON. Automatic ports are probed here; at start they are probed on rank 0's host."""
    from tpudist.launch.supervisor import reach_address

    plan = build_plan(args, cluster, choose_ports(args, free_ports(2)), job_id="dry-run",
                      coordinator=reach_address(args, cluster))
    sys.stdout.buffer.write(plan_json(plan).encode("utf-8", "surrogateescape") + b"\n")
    sys.stdout.flush()
    return 0
