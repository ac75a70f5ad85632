"""What a launch is asked to do: `LaunchConfig`, built once from the command line, never changed.

Every part of the launcher takes the piece it needs as a typed, frozen value: the cluster sources a
`ClusterOptions`, the planner a `ProcessOptions` (and the ports of `JobOptions`), the transport an
`SshOptions`, the supervisor the whole `LaunchConfig`. `args.parse_args` builds it from flags; code
can build one directly:

    config = LaunchConfig(cluster=ClusterOptions(hosts="10.0.0.2,10.0.0.3"),
                          procs=ProcessOptions(command=("python", "train.py"), nproc_per_host=2))
    assert config.job.max_restarts == 0 and config.procs.env == {}

A value out of range raises ValueError naming the flag, the value and the rule, whichever way the
config is built. Standard library only: importing this costs the launcher nothing.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

PLATFORMS = ("cpu", "gpu", "tpu")
RESTART_ON = ("infra", "hang", "any")  # --restart-on: which failures --max-restarts runs the job again after (a comma list)
DEFAULT_PROFILE_STEPS = (2, 5)  # past the compiling first steps; three steps in the steady state


def _check_at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag} {value} must be at least {low}")


def _check_port(flag: str, value: int | None) -> None:
    if value is not None and not 0 < value < 65536:
        raise ValueError(f"{flag} {value} is not a port (1..65535)")


def _check_seconds(flag: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{flag} {value} must be a positive number of seconds")


HANG_ACTIONS = ("stop", "report")


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """Where the job runs: what the cluster sources read to find the hosts (at most one of
    `local`, `hosts`, `hostfile`, `tpu`, `ray`; none: a SLURM allocation, else this machine)."""

    local: bool = False
    """`--local`: this machine, without SSH."""
    hosts: str | None = None
    """`--hosts h1,h2`: SSH hosts, each `[user@]host[:port]`, worker 0 first."""
    hostfile: str | None = None
    """`--hostfile FILE`: an MPI/DeepSpeed hostfile, `host slots=N` per line."""
    tpu: str | None = None
    """`--tpu NAME[,NAME...]`: Cloud TPU VM slices by name, one job over all of them (`local`: the
    slice this VM belongs to)."""
    zone: str | None = None
    """`--zone`: the TPU's zone; None: gcloud's configured one."""
    project: str | None = None
    """`--project`: the TPU's project; None: gcloud's configured one."""
    internal_ip: bool = False
    """`--internal-ip`: connect to TPU workers' internal IPs (default: external, as gcloud does)."""
    num_slices: int | None = None
    """`--num-slices N`: the hosts (or one host's processes) form N slices, in contiguous blocks;
    None: one slice per --tpu name, per hostfile `slice=` value, else 1."""
    ray: str | None = None
    """`--ray ADDRESS`: the nodes of a running Ray cluster (`auto`, `host:port`, `ray://host:10001`),
    one agent per node placed through Ray instead of SSH."""

    def __post_init__(self) -> None:
        given = [f"--{name}" for name in ("local", "hosts", "hostfile", "tpu", "ray") if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both say where to run; give at most one")
        _check_at_least("--num-slices", self.num_slices, 1)

    @property
    def tpu_names(self) -> tuple[str, ...]:
        """The slices `--tpu` names, in slice order (`--tpu a,b`: slice 0 is a)."""
        return tuple(n.strip() for n in self.tpu.split(",")) if self.tpu else ()


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
    """What runs on every host: the command, how many processes, their environment."""

    command: tuple[str, ...] = ()
    """The program and its arguments, exactly as given after `--`."""
    nproc_per_host: int | None = None
    """`--nproc-per-host N`; None: each host's slots, else the TPU's default, else 1."""
    cpu_devices: int | None = None
    """`--cpu-devices K`: XLA CPU devices per process (a CPU mesh; the platform becomes cpu)."""
    platform: str | None = None
    """`--platform`: "cpu", "gpu" or "tpu"; None: tpu on a TPU slice, cpu with cpu_devices, else JAX's."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """`--env-file` then `--env K=V` / `--env K` values, in order, set for every process last
    (read-only; never printed where the name looks secret: `_env.looks_secret`)."""
    workdir: str = ""
    """`--workdir DIR`: the processes' working directory; "": the launcher's current directory."""
    venv: str | None = None
    """`--venv PATH`: the agent and the processes run with this virtualenv's Python."""
    conda_env: str | None = None
    """`--conda-env NAME`: the processes run inside this conda environment."""
    python: str | None = None
    """`--python PATH`: the interpreter (with tpudist) that runs the agent; None: the launcher's."""
    profile_dir: str | None = None
    """`--profile DIR`: trace steps of `fit` on every process; the traces are copied back to DIR."""
    profile_steps: tuple[int, int] = DEFAULT_PROFILE_STEPS
    """`--profile-steps A:B`: the steps of `fit` to trace, 0-based, B exclusive."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))  # normalising, before anyone reads it
        object.__setattr__(self, "env", types.MappingProxyType(dict(self.env)))
        object.__setattr__(self, "profile_steps", tuple(self.profile_steps))
        _check_at_least("--nproc-per-host", self.nproc_per_host, 1)
        _check_at_least("--cpu-devices", self.cpu_devices, 1)
        first, end = self.profile_steps
        if not 0 <= first < end:
            raise ValueError(f"--profile-steps {first}:{end} must be A:B with 0 <= A < B (steps A..B-1 "
                             "of fit, counted from 0)")
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"--platform {self.platform!r} must be one of {', '.join(PLATFORMS)}")
        if self.venv and self.conda_env:
            raise ValueError("--venv and --conda-env both choose the Python environment; give one")

    @property
    def cwd(self) -> str:
        """The processes' working directory, absolute."""
        return os.path.abspath(self.workdir) if self.workdir else os.getcwd()


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How every host is reached (each host's own `user@host:port` wins, then these, then
    ~/.ssh/config, as in OpenSSH)."""

    user: str | None = None
    """`--ssh-user`; None: ~/.ssh/config's User, else the current user."""
    port: int | None = None
    """`--ssh-port`; None: ~/.ssh/config's Port, else 22."""
    key: str | None = None
    """`--ssh-key FILE`; None: ~/.ssh/config's IdentityFile, the SSH agent, ~/.ssh/id_*."""
    known_hosts: str | None = None
    """`--known-hosts FILE`; None: ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts."""
    accept_new: bool = False
    """`--accept-new-host-keys`: add unknown host keys (never a changed one)."""
    connect_timeout: float = 30.0
    """`--connect-timeout S`: seconds for the TCP connect, banner, login and channel of each host."""
    config_path: str = "~/.ssh/config"
    """`--ssh-config FILE`: the OpenSSH client configuration to honour."""
    fanout: int = 64
    """`--fanout N`: SSH handshakes in flight at once."""

    def __post_init__(self) -> None:
        _check_port("--ssh-port", self.port)
        _check_seconds("--connect-timeout", self.connect_timeout)
        _check_at_least("--fanout", self.fanout, 1)

    def config(self) -> "paramiko.SSHConfig":
        """The parsed ~/.ssh/config (empty when the file does not exist)."""
        import paramiko

        path = os.path.expanduser(self.config_path)
        return paramiko.SSHConfig.from_path(path) if os.path.exists(path) else paramiko.SSHConfig()


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """How the job is run, stopped and restarted."""

    start_timeout: float = 120.0
    """`--start-timeout S`: seconds for every host's agent to report after connecting."""
    stop_grace: float = 3.0
    """`--stop-grace S`: seconds between SIGTERM and SIGKILL when processes are stopped."""
    max_restarts: int = 0
    """`--max-restarts N`: run the whole job again after a failure, up to N times."""
    restart_on: str = "infra"
    """`--restart-on`: which failures restart, a comma list: "infra" (a lost host or SSH connection, a
    signal, exit 42 or 128+), "hang" (no progress for --hang-timeout), "any" (every failure, a
    program's own error such as exit 1 too); e.g. "infra,hang"."""
    coordinator_port: int | None = None
    """`--coordinator-port`: the JAX coordinator's port on a multi-host job (a one-host job's is a Unix
    socket); None: one found free on rank 0's host."""
    master_port: int | None = None
    """`--master-port`: MASTER_PORT for torch; None: one found free on rank 0's host."""
    dry_run: bool = False
    """`--dry-run`: print the plan as JSON and start nothing."""
    skip_preflight: bool = False
    """`--skip-preflight`: start even when a host's TPU is held by another process or locked."""
    hang_timeout: float | None = None
    """`--hang-timeout S`: when no rank made progress (a line of output, an eager collective) for S
    seconds, collect every rank's Python stacks and print them in one table; None: never."""
    hang_action: str = "stop"
    """`--hang-action`: "stop" ends the job after the table (exit status 124), "report" lets it run."""
    min_hosts: int | None = None
    """`--min-hosts N`: a restart goes on without the hosts that cannot be reached again, while at
    least N hosts remain (new ranks over the survivors); None: a restart needs every host."""
    rejoin: bool = False
    """`--rejoin`: before each restart, try the hosts dropped by --min-hosts again and take back those
    that answer."""

    def __post_init__(self) -> None:
        _check_seconds("--start-timeout", self.start_timeout)
        if self.stop_grace < 0:
            raise ValueError(f"--stop-grace {self.stop_grace} must be >= 0")
        _check_at_least("--max-restarts", self.max_restarts, 0)
        if not self.restart_on or any(part not in RESTART_ON for part in self.restart_on.split(",")):
            raise ValueError(f"--restart-on {self.restart_on!r} must be one or more of {', '.join(RESTART_ON)}, "
                             f"comma-separated (e.g. infra,hang)")
        _check_port("--coordinator-port", self.coordinator_port)
        if self.hang_timeout is not None:
            _check_seconds("--hang-timeout", self.hang_timeout)
        if self.hang_action not in HANG_ACTIONS:
            raise ValueError(f"--hang-action {self.hang_action!r} must be one of {', '.join(HANG_ACTIONS)}")
        _check_port("--master-port", self.master_port)
        if self.min_hosts is not None:
            _check_at_least("--min-hosts", self.min_hosts, 1)
            if not self.max_restarts:
                raise ValueError(f"--min-hosts {self.min_hosts} continues a job on fewer hosts at a restart, "
                                 "and no restart is allowed: add --max-restarts N")
        if self.rejoin and self.min_hosts is None:
            raise ValueError("--rejoin takes back hosts that --min-hosts dropped: add --min-hosts N")
        if self.coordinator_port and self.coordinator_port == self.master_port:
            raise ValueError(f"--coordinator-port and --master-port are both {self.master_port}; "
                             "they must differ")


DEFAULT_LOG_PREFIX = "[w{worker} r{rank} {host}] "
PREFIX_FIELDS = ("worker", "rank", "local_rank", "host")


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """What reaches the console and the log files."""

    log_prefix: str = DEFAULT_LOG_PREFIX
    """`--log-prefix`: each line's prefix; fields {worker}, {rank}, {local_rank}, {host}."""
    log_dir: str | None = None
    """`--log-dir DIR`: also write each rank's lines to DIR/rank<R>.log."""
    ranks: frozenset[int] | None = None
    """`--ranks-filter 0,3`: the ranks whose lines reach the console; None: every rank."""
    quiet: bool = False
    """`--quiet`: no live status or summary, only the processes' lines."""
    verbose: bool = False
    """`-v`: say which cluster source was chosen and why; show the runtime's connection chatter."""

    def __post_init__(self) -> None:
        if self.ranks is not None:
            object.__setattr__(self, "ranks", frozenset(self.ranks))
            if any(r < 0 for r in self.ranks):
                raise ValueError(f"--ranks-filter {self.ranks_text}: ranks are >= 0")
        _check_prefix(self.log_prefix)

    @property
    def ranks_text(self) -> str:
        return ",".join(str(r) for r in sorted(self.ranks or ()))


def _check_prefix(template: str) -> None:
    import string

    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"--log-prefix {template!r}: {e}") from None
    unknown = fields - set(PREFIX_FIELDS)
    if unknown:
        raise ValueError(f"--log-prefix {template!r} uses {sorted(unknown)}; known fields are "
                         f"{', '.join('{%s}' % f for f in PREFIX_FIELDS)}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launch: where, what, how to reach the hosts, how to run the job, what to show."""

    cluster: ClusterOptions = dataclasses.field(default_factory=ClusterOptions)
    """Where the job runs (read by the cluster sources)."""
    procs: ProcessOptions = dataclasses.field(default_factory=ProcessOptions)
    """The command and the processes' number and environment (read by the planner)."""
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)
    """How hosts are reached over SSH (read by the transport)."""
    job: JobOptions = dataclasses.field(default_factory=JobOptions)
    """Timeouts, stopping, restarts and ports (read by the supervisor)."""
    output: OutputOptions = dataclasses.field(default_factory=OutputOptions)
    """Console and log files."""
