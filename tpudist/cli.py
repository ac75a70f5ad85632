"""The `tpudist` console script.

    tpudist launch [launcher flags] -- python train.py    # the same as python -m tpudist.xla_dist
    tpudist doctor [--hosts ... | --hostfile ... | --tpu ...]   # every cluster source's verdict, and why
    tpudist --version
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: tpudist {launch,doctor} ...

  launch   run a program on every host: tpudist launch [flags] -- python train.py
  doctor   show which cluster source applies to these flags, and why each does or does not
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
        import tpudist

        print(f"tpudist {tpudist.__version__}")
        return 0
    print(f"tpudist: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


def doctor(argv: Sequence[str]) -> int:
    """Prints every registered cluster source's verdict for these flags, then what would run."""
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
        return 1
    hosts = ", ".join(str(h) for h in cluster.hosts[:8]) + (" ..." if len(cluster.hosts) > 8 else "")
    print(f"\nchosen: {cluster.source}: {len(cluster.hosts)} host(s): {hosts}"
          + (f"; accelerator {cluster.accelerator_type}" if cluster.accelerator_type else ""))
    return 0


if __name__ == "__main__":
    main()
