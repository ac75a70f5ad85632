"""The `tpudist` console script.

    tpudist launch [launcher flags] -- python train.py    # the same as python -m tpudist.xla_dist
    tpudist doctor [--hosts ... | --hostfile ... | --tpu ...]   # every cluster source's verdict, and why;
                                                                # whether this host's TPU is free
    tpudist --version
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: tpudist {launch,doctor} ...

  launch   run a program on every host: tpudist launch [flags] -- python train.py
  doctor   show which cluster source applies to these flags, and why each does or does not;
           whether this host's TPU is held by another process or locked, and the fix
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a subcommand; called without `argv` (as the console script) it ends the process itself."""
    if argv is None:
        from tpudist.xla_dist import exit_now

        exit_now(_run(sys.argv[1:]))
    return _run(list(argv))


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "launch":
        from tpudist.xla_dist import main as launch

        return launch(rest, prog="tpudist launch")
    if command == "doctor":
        return doctor(rest)
    if command == "--version":
        from tpudist._version import __version__

        print(f"tpudist {__version__}")
        return 0
    print(f"tpudist: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


def doctor(argv: Sequence[str]) -> int:
    """Prints every registered cluster source's verdict for these flags, then what would run, then
    this host's TPU preflight. Exit status 1 when no cluster applies or the TPU is not free."""
    from tpudist.launch.args import build_parser, cluster_options
    from tpudist.launch.clusters import choose_cluster, verdicts

    options = cluster_options(build_parser("tpudist doctor").parse_args(list(argv)))
    results = verdicts(options)
    width = max(len(name) for name, _ in results)
    for name, verdict in results:
        print(f"{name:<{width}}  {'yes' if verdict.applies else 'no ':<3}  {verdict.reason}")
    try:
        cluster = choose_cluster(options)
    except ValueError as e:
        print(f"\nno cluster: {e}")
        return 1 | tpu_doctor()
    hosts = ", ".join(str(h) for h in cluster.hosts[:8]) + (" ..." if len(cluster.hosts) > 8 else "")
    print(f"\nchosen: {cluster.source}: {len(cluster.hosts)} host(s): {hosts}"
          + (f"; accelerator {cluster.accelerator_type}" if cluster.accelerator_type else ""))
    return tpu_doctor()


def tpu_doctor() -> int:
    """This host's TPU: its device nodes, and whether another process or a stale lock holds it
    (the check every agent makes before a job starts). 1 when it is not free."""
    import os

    import tpudist.contract as contract
    from tpudist.launch.agent._tpucheck import check, describe

    devices = os.environ.get(contract.TPU_DEVICES) or contract.DEFAULT_TPU_DEVICES
    lockfile = os.environ.get(contract.LIBTPU_LOCKFILE) or contract.DEFAULT_LIBTPU_LOCKFILE
    found = check(devices, lockfile)
    if not found.checked:
        print(f"\ntpu: no TPU device node on this host ({devices}): nothing to check")
        return 0
    shown = ", ".join(found.devices[:8]) + (" ..." if len(found.devices) > 8 else "")
    print(f"\ntpu: {len(found.devices)} device node(s): {shown}; "
          + ("free" if not found.problems else "NOT FREE"))
    for problem in found.problems:
        print(f"  {problem.kind}: {describe(problem)}")
    if found.unreadable:
        print(f"  ({found.unreadable} processes of other users could not be inspected; run as root to "
              "see every holder)")
    return 1 if found.problems else 0


if __name__ == "__main__":
    main()
