"""The launcher's command line: `python -m tpudist.xla_dist [flags] -- command ...`.

`parse_args` returns an `argparse.Namespace` (cluster sources read it) with the user's values
checked: `--env K=V` pairs become `args.env_vars` (an ordered dict), `--ranks-filter` becomes
`args.ranks` (a set, or None), and `args.command` is the program to run. Bad input raises ValueError
naming the value and the fix.

    args = parse_args(["--tpu=my-tpu", "--conda-env=torch-xla-1.6", "--env", "A=1", "--",
                       "python", "train.py", "--lr", "0.1"])
    assert args.command == ["python", "train.py", "--lr", "0.1"] and args.env_vars == {"A": "1"}
"""

from __future__ import annotations

import argparse
import os
import re
import string
from collections.abc import Sequence

from tpudist import contract

DEFAULT_LOG_PREFIX = "[w{worker} r{rank} {host}] "
PREFIX_FIELDS = ("worker", "rank", "local_rank", "host")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The launcher owns these: a user value would give processes a different idea of the job than the
# launcher's, so `--env` may not set them.
RESERVED_ENV = (contract.RANK, contract.WORLD_SIZE, contract.LOCAL_RANK, contract.LOCAL_WORLD_SIZE,
                contract.WORKER, contract.NUM_WORKERS, contract.JOB_ID, contract.RESTART)


def build_parser(prog: str = "python -m tpudist.xla_dist") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Run one program on every host of a TPU slice, an SSH cluster or this machine.",
        epilog="example: %(prog)s --hosts 10.0.0.2,10.0.0.3 --nproc-per-host 2 -- python train.py")
    where = p.add_argument_group("where to run (at most one; default --local)")
    cluster = where.add_mutually_exclusive_group()
    cluster.add_argument("--local", action="store_true", help="this machine, without SSH")
    cluster.add_argument("--hosts", metavar="H1,H2", help="SSH hosts, each [user@]host[:port], worker 0 first")
    cluster.add_argument("--hostfile", metavar="FILE", help="MPI/DeepSpeed hostfile: `host slots=N` per line")
    cluster.add_argument("--tpu", metavar="NAME", help="a Cloud TPU VM slice by name")
    where.add_argument("--zone", help="the TPU's zone (default: gcloud's or the metadata server's)")
    where.add_argument("--project", help="the TPU's project (default: gcloud's or the metadata server's)")
    where.add_argument("--internal-ip", action="store_true",
                       help="connect to the TPU workers' internal IPs (default: external, like "
                            "`gcloud compute tpus tpu-vm ssh`)")

    procs = p.add_argument_group("processes")
    procs.add_argument("--nproc-per-host", type=int, metavar="N",
                       help="processes per host (default: the host's slots, the TPU's chips, else 1)")
    procs.add_argument("--cpu-devices", type=int, metavar="K", help="XLA CPU devices per process (CPU mesh)")
    procs.add_argument("--platform", choices=("cpu", "gpu", "tpu"),
                       help="the JAX platform (default: tpu on a TPU, cpu with --cpu-devices, else JAX's)")
    procs.add_argument("--env", action="append", default=[], metavar="K=V",
                       help="set K=V for every process (repeatable)")
    procs.add_argument("--workdir", metavar="DIR", help="processes' working directory (default: this one)")
    py = procs.add_mutually_exclusive_group()
    py.add_argument("--venv", metavar="PATH", help="run agent and processes in this virtualenv on every host")
    py.add_argument("--conda-env", metavar="NAME", help="run the processes inside this conda environment")
    procs.add_argument("--python", metavar="PATH",
                       help="the interpreter (with tpudist) that runs the agent on every host "
                            "(default: this launcher's own)")

    ssh = p.add_argument_group("SSH (~/.ssh/config and the SSH agent are honoured)")
    ssh.add_argument("--ssh-user", metavar="USER")
    ssh.add_argument("--ssh-port", type=int, metavar="PORT")
    ssh.add_argument("--ssh-key", metavar="FILE", help="private key (default: ~/.ssh/config, the agent, ~/.ssh/id_*)")
    ssh.add_argument("--ssh-config", metavar="FILE", default="~/.ssh/config")
    ssh.add_argument("--known-hosts", metavar="FILE", help="known_hosts file (default: ~/.ssh/known_hosts)")
    ssh.add_argument("--accept-new-host-keys", action="store_true",
                     help="add unknown host keys to known_hosts (OpenSSH's accept-new); changed keys still fail")
    ssh.add_argument("--connect-timeout", type=float, default=30.0, metavar="S",
                     help="seconds to reach and log in to each host (default 30)")
    ssh.add_argument("--fanout", type=int, default=64, metavar="N", help="SSH connections opened at once")

    job = p.add_argument_group("job")
    job.add_argument("--start-timeout", type=float, default=120.0, metavar="S",
                     help="seconds for every host's agent to report after connecting (default 120)")
    job.add_argument("--stop-grace", type=float, default=3.0, metavar="S",
                     help="seconds between SIGTERM and SIGKILL when stopping processes (default 3)")
    job.add_argument("--max-restarts", type=int, default=0, metavar="N", help="restart the job after a failure")
    job.add_argument("--coordinator-port", type=int, metavar="PORT", help="JAX coordinator port (default: a free one)")
    job.add_argument("--master-port", type=int, metavar="PORT", help="MASTER_PORT (default: a free one)")
    job.add_argument("--dry-run", action="store_true", help="print the plan as JSON and start nothing")

    out = p.add_argument_group("output")
    out.add_argument("--log-prefix", default=DEFAULT_LOG_PREFIX, metavar="TEMPLATE",
                     help=f"line prefix; fields {', '.join('{%s}' % f for f in PREFIX_FIELDS)}")
    out.add_argument("--log-dir", metavar="DIR", help="also write each rank's lines to DIR/rank<R>.log")
    out.add_argument("--ranks-filter", metavar="0,3", help="print only these ranks' lines")
    out.add_argument("--quiet", action="store_true", help="no status or summary, only the processes' lines")
    out.add_argument("-v", "--verbose", action="store_true", help="say which cluster source was chosen and why")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after --")
    return p


def parse_env(values: Sequence[str]) -> dict[str, str]:
    """`["K=V", ...]` -> {K: V}. K must be a variable name; V is kept byte for byte."""
    env: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env {item!r} has no '='; write --env NAME=VALUE")
        if not _NAME_RE.match(name):
            raise ValueError(f"--env {item!r}: {name!r} is not a valid variable name "
                             "(letters, digits and _, not starting with a digit)")
        if name in RESERVED_ENV:
            raise ValueError(f"--env {item!r}: {name} is set by the launcher for each process and "
                             "cannot be overridden")
        env[name] = value
    return env


def parse_ranks(value: str | None) -> set[int] | None:
    """`"0,3"` -> {0, 3}."""
    if value is None:
        return None
    try:
        ranks = {int(r) for r in value.split(",")}
    except ValueError:
        raise ValueError(f"--ranks-filter {value!r} must be comma-separated ranks, e.g. 0,3") from None
    if any(r < 0 for r in ranks):
        raise ValueError(f"--ranks-filter {value!r}: ranks are >= 0")
    return ranks


def check_prefix(template: str) -> None:
    """Raises ValueError unless the template uses only the known fields."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"--log-prefix {template!r}: {e}") from None
    unknown = fields - set(PREFIX_FIELDS)
    if unknown:
        raise ValueError(f"--log-prefix {template!r} uses {sorted(unknown)}; known fields are "
                         f"{', '.join('{%s}' % f for f in PREFIX_FIELDS)}")


def parse_args(argv: Sequence[str], prog: str = "python -m tpudist.xla_dist") -> argparse.Namespace:
    """Parses and checks the launcher's flags. Raises ValueError on bad values."""
    argv = list(argv)
    parser = build_parser(prog)
    if "--" in argv:  # everything after the first `--` is the command, verbatim
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        if args.command:
            raise ValueError(f"unexpected {args.command[0]!r} before '--'; put the command after '--'")
        args.command = argv[cut + 1:]
    else:
        args = parser.parse_args(argv)
    if not args.command:
        raise ValueError("no command given; write: python -m tpudist.xla_dist [flags] -- python train.py")
    args.env_vars = parse_env(args.env)
    args.ranks = parse_ranks(args.ranks_filter)
    check_prefix(args.log_prefix)
    for flag, value, low in (("--nproc-per-host", args.nproc_per_host, 1), ("--cpu-devices", args.cpu_devices, 1),
                             ("--fanout", args.fanout, 1), ("--max-restarts", args.max_restarts, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value} must be at least {low}")
    for flag, value in (("--connect-timeout", args.connect_timeout), ("--start-timeout", args.start_timeout)):
        if value <= 0:
            raise ValueError(f"{flag} {value} must be a positive number of seconds")
    if args.stop_grace < 0:
        raise ValueError(f"--stop-grace {args.stop_grace} must be >= 0")
    for flag, value in (("--ssh-port", args.ssh_port), ("--coordinator-port", args.coordinator_port),
                        ("--master-port", args.master_port)):
        if value is not None and not 0 < value < 65536:
            raise ValueError(f"{flag} {value} is not a port (1..65535)")
    if args.coordinator_port and args.coordinator_port == args.master_port:
        raise ValueError(f"--coordinator-port and --master-port are both {args.master_port}; they must differ")
    args.workdir = os.path.abspath(args.workdir) if args.workdir else os.getcwd()
    return args
