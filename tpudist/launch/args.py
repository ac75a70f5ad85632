"""The launcher's command line: `python -m tpudist.xla_dist [flags] -- command ...` -> `LaunchConfig`.

`parse_args` checks the user's values once and returns the frozen `LaunchConfig` every other part
reads: `--env-file` then `--env` values become `config.procs.env` (in order; `_env.py`),
`--ranks-filter` becomes `config.output.ranks`, everything after the first `--` is
`config.procs.command`, verbatim. Bad input raises ValueError naming the value and the fix
(argparse's own errors exit with status 2).

    config = parse_args(["--tpu=my-tpu", "--conda-env=torch-xla-1.6", "--env", "A=1", "--",
                         "python", "train.py", "--lr", "0.1"])
    assert config.procs.command == ("python", "train.py", "--lr", "0.1")
    assert config.procs.env == {"A": "1"} and config.cluster.tpu == "my-tpu"
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import tpudist.contract as contract
from tpudist.launch import _env
from tpudist.launch.config import RESTART_ON
from tpudist.launch.config import (DEFAULT_LOG_PREFIX, DEFAULT_PROFILE_STEPS, HANG_ACTIONS, PLATFORMS,
                                   PREFIX_FIELDS, ClusterOptions, JobOptions, LaunchConfig, OutputOptions,
                                   ProcessOptions, SshOptions)

PROG = "python -m tpudist.xla_dist"
# The launcher owns these: a user value would give processes a different idea of the job than the
# launcher's, so `--env` may not set them.
RESERVED_ENV = (contract.RANK, contract.WORLD_SIZE, contract.LOCAL_RANK, contract.LOCAL_WORLD_SIZE,
                contract.WORKER, contract.NUM_WORKERS, contract.JOB_ID, contract.RESTART, contract.STOP_GRACE,
                contract.NUM_SLICES, contract.SLICE_ID, contract.PROFILE_DIR, contract.NNODES, contract.NODE_RANK,
                contract.JOB_COMPLETION_INDEX)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Run one program on every host of a TPU slice, an SSH cluster or this machine.",
        epilog="example: %(prog)s --hosts 10.0.0.2,10.0.0.3 --nproc-per-host 2 -- python train.py")
    where = p.add_argument_group("where to run (at most one; default --local)")
    cluster = where.add_mutually_exclusive_group()
    cluster.add_argument("--local", action="store_true", help="this machine, without SSH")
    cluster.add_argument("--hosts", metavar="H1,H2", help="SSH hosts, each [user@]host[:port], worker 0 first")
    cluster.add_argument("--hostfile", metavar="FILE", help="MPI/DeepSpeed hostfile: `host slots=N` per line")
    cluster.add_argument("--ray", metavar="ADDRESS",
                         help="the nodes of a running Ray cluster (auto, HOST:PORT, ray://HOST:10001): one agent "
                              "per node (per TPU host where nodes have TPUs), placed through Ray instead of SSH")
    cluster.add_argument("--tpu", metavar="NAME[,NAME]",
                         help="a Cloud TPU VM slice by name; several names: one job over all of them")
    where.add_argument("--zone", help="the TPU's zone (default: gcloud's or the metadata server's)")
    where.add_argument("--project", help="the TPU's project (default: gcloud's or the metadata server's)")
    where.add_argument("--internal-ip", action="store_true",
                       help="connect to the TPU workers' internal IPs (default: external, like "
                            "`gcloud compute tpus tpu-vm ssh`)")
    where.add_argument("--num-slices", type=int, metavar="N",
                       help="the hosts form N slices in contiguous blocks (one host: its processes "
                            "do), with MEGASCALE_* set (default: one per --tpu name or hostfile slice=)")

    procs = p.add_argument_group("processes")
    procs.add_argument("--nproc-per-host", type=int, metavar="N",
                       help="processes per host (default: the hostfile's slots, else 1; on a TPU 1 per worker, "
                            "which drives all its chips; a TPU also takes its chips per worker: one per chip)")
    procs.add_argument("--cpu-devices", type=int, metavar="K", help="XLA CPU devices per process (CPU mesh)")
    procs.add_argument("--platform", choices=PLATFORMS,
                       help="the JAX platform (default: tpu on a TPU, cpu with --cpu-devices, else JAX's)")
    procs.add_argument("--env", action="append", default=[], metavar="K=V|K",
                       help="set K=V for every process, or K to pass the launcher's own value of K "
                            "(keeps a secret out of the command line; repeatable)")
    procs.add_argument("--env-file", action="append", default=[], metavar="FILE",
                       help="KEY=VALUE lines (# comments; KEY alone: the launcher's value) for every "
                            "process; --env wins (repeatable)")
    procs.add_argument("--workdir", metavar="DIR", help="processes' working directory (default: this one)")
    py = procs.add_mutually_exclusive_group()
    py.add_argument("--venv", metavar="PATH", help="run agent and processes in this virtualenv on every host")
    py.add_argument("--conda-env", metavar="NAME", help="run the processes inside this conda environment")
    procs.add_argument("--python", metavar="PATH",
                       help="the interpreter (with tpudist) that runs the agent on every host "
                            "(default: this launcher's own)")
    procs.add_argument("--profile", metavar="DIR",
                       help="trace steps of fit on every process and copy the traces back to DIR")
    procs.add_argument("--profile-steps", metavar="A:B",
                       help="the steps of fit to trace, 0-based, B exclusive (default %d:%d)"
                            % DEFAULT_PROFILE_STEPS)

    ssh = p.add_argument_group("SSH (~/.ssh/config and the SSH agent are honoured)")
    ssh.add_argument("--ssh-user", metavar="USER")
    ssh.add_argument("--ssh-port", type=int, metavar="PORT")
    ssh.add_argument("--ssh-key", metavar="FILE",
                     help="private key (default: ~/.ssh/config's IdentityFile, gcloud's "
                          "~/.ssh/google_compute_engine, the agent, ~/.ssh/id_*)")
    ssh.add_argument("--ssh-config", metavar="FILE", default=SshOptions.config_path)
    ssh.add_argument("--known-hosts", metavar="FILE", help="known_hosts file (default: ~/.ssh/known_hosts)")
    ssh.add_argument("--accept-new-host-keys", action="store_true",
                     help="add unknown host keys to known_hosts (OpenSSH's accept-new); changed keys still fail")
    ssh.add_argument("--connect-timeout", type=float, default=SshOptions.connect_timeout, metavar="S",
                     help="seconds to reach and log in to each host (default %(default)g)")
    ssh.add_argument("--fanout", type=int, default=SshOptions.fanout, metavar="N", help="SSH connections opened at once")

    job = p.add_argument_group("job")
    job.add_argument("--start-timeout", type=float, default=JobOptions.start_timeout, metavar="S",
                     help="seconds for every host's agent to report after connecting (default %(default)g)")
    job.add_argument("--stop-grace", type=float, default=JobOptions.stop_grace, metavar="S",
                     help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)g)")
    job.add_argument("--max-restarts", type=int, default=JobOptions.max_restarts, metavar="N",
                     help="run the whole job again after a failure, up to N times")
    job.add_argument("--restart-on", default=JobOptions.restart_on, metavar="|".join(RESTART_ON),
                     help="which failures restart, comma-separated: infra (a lost host or SSH connection, a "
                          "signal such as SIGKILL or a preemption's SIGTERM, exit 42 or 128+), hang (no "
                          "progress for --hang-timeout), any (also the program's own errors, e.g. exit 1); "
                          "e.g. infra,hang (default %(default)s)")
    job.add_argument("--min-hosts", type=int, metavar="N",
                     help="elastic restarts: a host that cannot be reached again at a restart is dropped "
                          "and the job goes on over the others (new ranks, a smaller mesh), while at least "
                          "N hosts remain; needs --max-restarts (default: a restart needs every host)")
    job.add_argument("--rejoin", action="store_true",
                     help="with --min-hosts: before each restart, try the dropped hosts again and take "
                          "back those that answer")
    job.add_argument("--coordinator-port", type=int, metavar="PORT",
                     help="JAX coordinator port of a multi-host job, checked free before the launch "
                          "(default: a free one; a one-host job uses a private Unix socket)")
    job.add_argument("--master-port", type=int, metavar="PORT", help="MASTER_PORT (default: a free one)")
    job.add_argument("--dry-run", action="store_true", help="print the plan as JSON and start nothing")
    job.add_argument("--skip-preflight", action="store_true",
                     help="start even if a host's TPU is held by another process or its libtpu lock "
                          "file is stale")
    job.add_argument("--hang-timeout", type=float, metavar="S",
                     help="when no rank made progress (a line of output, an eager collective) for S "
                          "seconds, print every rank's Python stacks in one table (SIGQUIT to the "
                          "launcher prints it at any time)")
    job.add_argument("--hang-action", choices=HANG_ACTIONS, default="stop",
                     help="after that table: stop the job (exit status 124) or let it run on "
                          "(default %(default)s)")

    out = p.add_argument_group("output")
    out.add_argument("--log-prefix", default=DEFAULT_LOG_PREFIX, metavar="TEMPLATE",
                     help=f"line prefix; fields {', '.join('{%s}' % f for f in PREFIX_FIELDS)}")
    out.add_argument("--log-dir", metavar="DIR", help="also write each rank's lines to DIR/rank<R>.log")
    out.add_argument("--ranks-filter", metavar="0,3", help="print only these ranks' lines")
    out.add_argument("--quiet", action="store_true", help="no status or summary, only the processes' lines")
    out.add_argument("-v", "--verbose", action="store_true",
                     help="say which cluster source was chosen and why; show the runtime's connection "
                          "chatter (gloo, absl INFO)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after --")
    return p


def parse_env(values: Sequence[str], files: Sequence[str] = ()) -> dict[str, str]:
    """--env-file then --env values -> {K: V}, the launcher's own variables refused (see _env.py)."""
    return _env.parse_env(values, files, reserved=RESERVED_ENV)


def parse_ranks(value: str | None) -> frozenset[int] | None:
    """`"0,3"` -> {0, 3}."""
    if value is None:
        return None
    try:
        ranks = frozenset(int(r) for r in value.split(","))
    except ValueError:
        raise ValueError(f"--ranks-filter {value!r} must be comma-separated ranks, e.g. 0,3") from None
    if any(r < 0 for r in ranks):
        raise ValueError(f"--ranks-filter {value!r}: ranks are >= 0")
    return ranks


def parse_steps(value: str | None, profile_dir: str | None) -> tuple[int, int]:
    """`--profile-steps "A:B"` -> (A, B); only with --profile."""
    if value is None:
        return DEFAULT_PROFILE_STEPS
    if profile_dir is None:
        raise ValueError(f"--profile-steps {value} needs --profile DIR (where the traces go)")
    first, sep, end = value.partition(":")
    if not sep or not first.strip().isdigit() or not end.strip().isdigit():
        raise ValueError(f"--profile-steps {value!r} must be A:B, e.g. 10:15 (steps 10..14 of fit)")
    return int(first), int(end)


def cluster_options(ns: argparse.Namespace) -> ClusterOptions:
    """The "where" flags of a parsed command line (also what `tpudist doctor` reads)."""
    return ClusterOptions(local=ns.local, hosts=ns.hosts, hostfile=ns.hostfile, tpu=ns.tpu, zone=ns.zone,
                          project=ns.project, internal_ip=ns.internal_ip, num_slices=ns.num_slices, ray=ns.ray)


def parse_args(argv: Sequence[str], prog: str = PROG) -> LaunchConfig:
    """Parses and checks the launcher's flags. Raises ValueError on bad values."""
    argv = list(argv)
    parser = build_parser(prog)
    if "--" in argv:  # everything after the first `--` is the command, verbatim
        cut = argv.index("--")
        ns = parser.parse_args(argv[:cut])
        if ns.command:
            raise ValueError(f"unexpected {ns.command[0]!r} before '--'; put the command after '--'")
        command = argv[cut + 1:]
    else:
        ns = parser.parse_args(argv)
        command = ns.command
    if not command:
        raise ValueError(f"no command given; write: {PROG} [flags] -- python train.py")
    for name in _env.secrets_in_argv(ns.env):
        print(f"{prog}: warning: the value of --env {name}=... is in this command line, which every user "
              f"of this machine can read (ps); export {name} and pass --env {name}, or use --env-file",
              file=sys.stderr)
    return LaunchConfig(
        cluster=cluster_options(ns),
        procs=ProcessOptions(
            command=tuple(command), nproc_per_host=ns.nproc_per_host, cpu_devices=ns.cpu_devices,
            platform=ns.platform, env=parse_env(ns.env, ns.env_file),
            workdir=os.path.abspath(ns.workdir) if ns.workdir else os.getcwd(),
            venv=ns.venv, conda_env=ns.conda_env, python=ns.python,
            profile_dir=os.path.abspath(ns.profile) if ns.profile else None,
            profile_steps=parse_steps(ns.profile_steps, ns.profile)),
        ssh=SshOptions(user=ns.ssh_user, port=ns.ssh_port, key=ns.ssh_key, known_hosts=ns.known_hosts,
                       accept_new=ns.accept_new_host_keys, connect_timeout=ns.connect_timeout,
                       config_path=ns.ssh_config, fanout=ns.fanout),
        job=JobOptions(start_timeout=ns.start_timeout, stop_grace=ns.stop_grace, max_restarts=ns.max_restarts,
                       restart_on=ns.restart_on, min_hosts=ns.min_hosts, rejoin=ns.rejoin,
                       coordinator_port=ns.coordinator_port, master_port=ns.master_port, dry_run=ns.dry_run,
                       skip_preflight=ns.skip_preflight, hang_timeout=ns.hang_timeout,
                       hang_action=ns.hang_action),
        output=OutputOptions(log_prefix=ns.log_prefix, log_dir=ns.log_dir, ranks=parse_ranks(ns.ranks_filter),
                             quiet=ns.quiet, verbose=ns.verbose))
