"""The `tpudist` console script.

    tpudist launch [launcher flags] -- python train.py    # the same as python -m tpudist.xla_dist
    tpudist doctor [--hosts ... | --hostfile ... | --tpu ... | --ray ...]
                        # every cluster source's verdict, and why; whether this host's TPU is free;
                        # the device each path computes on
    tpudist --version
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = """usage: tpudist {launch,doctor} ...

  launch   run a program on every host: tpudist launch [flags] -- python train.py
  doctor   show which cluster source applies to these flags, and why each does or does not;
           whether this host's TPU is held by another process or locked, and the fix;
           the device each path computes on (tpudist.compile, the dynamo backend, fused step, collectives)
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


def doctor_parser() -> argparse.ArgumentParser:
    """`tpudist doctor`'s own command line: the launcher's "where" flags (what `cluster_options` reads),
    nothing else, so `--help` describes doctor rather than the launcher."""
    p = argparse.ArgumentParser(
        prog="tpudist doctor", allow_abbrev=False,
        description="Show which cluster source applies to these flags and why each does or does not "
                    "(as `tpudist launch` with the same flags would choose), then whether this host's TPU "
                    "is free (a process holding its device nodes or a stale libtpu lock file, with the fix) and "
                    "which Python, torch and JAX are installed (and whether they are tested releases), then "
                    "which device each path computes on. Starts no job. Exit status 1 when no cluster applies, "
                    "the TPU is not free or JAX cannot list its devices.",
        epilog="examples: tpudist doctor --tpu my-slice --zone us-central2-b; tpudist doctor --tpu=local "
               "(on a TPU VM); tpudist doctor (no flags: what this machine looks like, e.g. a SLURM allocation)")
    where = p.add_argument_group("where the job would run (the launcher's flags; at most one)")
    cluster = where.add_mutually_exclusive_group()
    cluster.add_argument("--local", action="store_true", help="this machine, without SSH")
    cluster.add_argument("--hosts", metavar="H1,H2", help="SSH hosts, each [user@]host[:port], worker 0 first")
    cluster.add_argument("--hostfile", metavar="FILE", help="MPI/DeepSpeed hostfile: `host slots=N` per line")
    cluster.add_argument("--tpu", metavar="NAME[,NAME]", help="Cloud TPU VM slices by name (local: this VM's)")
    cluster.add_argument("--ray", metavar="ADDRESS", help="the nodes of a running Ray cluster (auto, HOST:PORT, "
                                                          "ray://HOST:10001)")
    where.add_argument("--zone", help="the TPU's zone (default: gcloud's or the metadata server's)")
    where.add_argument("--project", help="the TPU's project (default: gcloud's or the metadata server's)")
    where.add_argument("--internal-ip", action="store_true", help="the TPU workers' internal IPs")
    where.add_argument("--num-slices", type=int, metavar="N", help="the hosts form N slices")
    return p


def doctor(argv: Sequence[str]) -> int:
    """Prints every registered cluster source's verdict for these flags, then what would run, then
    this host's TPU preflight and the device each path computes on. Exit status 1 when no cluster
    applies, the TPU is not free or JAX cannot list its devices."""
    from tpudist.launch.args import cluster_options
    from tpudist.launch.clusters import choose_cluster, verdicts

    options = cluster_options(doctor_parser().parse_args(list(argv)))
    results = verdicts(options)
    width = max(len(name) for name, _ in results)
    for name, verdict in results:
        print(f"{name:<{width}}  {'yes' if verdict.applies else 'no ':<3}  {verdict.reason}")
    try:
        cluster = choose_cluster(options)
    except ValueError as e:
        print(f"\nno cluster: {e}")
        versions_doctor()
        return 1 | _device_doctors()
    hosts = ", ".join(str(h) for h in cluster.hosts[:8]) + (" ..." if len(cluster.hosts) > 8 else "")
    print(f"\nchosen: {cluster.source}: {len(cluster.hosts)} host(s): {hosts}"
          + (f"; accelerator {cluster.accelerator_type}" if cluster.accelerator_type else ""))
    versions_doctor()
    return _device_doctors()


def _device_doctors() -> int:
    """The TPU preflight, then (where the TPU is free: JAX could not open a held one) which device
    each path computes on."""
    return tpu_doctor() or devices_doctor()


def versions_doctor() -> None:
    """Python, torch and JAX as installed, each against the releases the suite runs on, and the ATen
    ops tpudist's op table names that this torch lacks (their lowerings are skipped)."""
    import platform

    from tpudist import _versions

    print(f"\nversions: python {platform.python_version()}; "
          + "; ".join(f"{p} {_versions.installed(p) or 'not installed'}" for p in _versions.TESTED))
    for line in _versions.untested() or ["every installed release is a tested one"]:
        print(f"  {line}")
    if _versions.installed("torch") is not None:
        from tpudist.compile._torch.lowering._registry import supported_ops
        from tpudist.compile._torch.lowering._table import missing_ops

        missing = missing_ops()
        supported = supported_ops()
        print(f"  torch ops lowered: {len(supported)}"
              + (f"; skipped, absent from this torch: {', '.join(missing)}" if missing else ""))


DEVICES_TIMEOUT_S = 90.0  # the longest `tpudist doctor` waits for a fresh process to list its devices
_DEVICES_CODE = ("from tpudist.compile._torch._placement import device_report\n"
                 "for path, where in device_report(): print(path, where, sep='\\t')")


def devices_doctor() -> int:
    """Which device each path computes on (the compiled module, the dynamo backend, the fused step's
    default mesh, the collectives), as a process started here sees them: a fresh process, so that
    this one neither holds the TPU nor waits without a deadline for JAX to start. 1 when it fails."""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", _DEVICES_CODE], capture_output=True, text=True,
                              timeout=DEVICES_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"\ndevices: JAX did not list its devices within {DEVICES_TIMEOUT_S:g} s")
        return 1
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        print(f"\ndevices: JAX could not start (exit code {done.returncode}):\n{tail}")
        return 1
    rows = [line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line]
    width = max(len(path) for path, _ in rows)
    print("\ndevices (where each path computes, in a process started here):")
    for path, where in rows:
        print(f"  {path:<{width}}  {where}")
    return 0


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
