"""The plan: which process runs where, with which argv and environment.

Ranks are numbered in worker order: worker 0's processes first (over several slices, slice-major:
every host of slice 0, then slice 1, ...). Every process gets the environment contract of
`tpudist.contract` (rank, sizes, coordinator = a private Unix socket on each host, relayed to rank 0's
through the agents' gate on a multi-host job), the TPU variables on a TPU slice,
the `MEGASCALE_*` variables in a job of several slices, torchrun's `NNODES` / `NODE_RANK`
(`contract.torchrun_environ`), what JAX's argument-less
`jax.distributed.initialize()` reads (`contract.jax_environ`), the profiling variables under
`--profile`, `PYTHONUNBUFFERED=1` (so lines arrive as they are printed), `TPUDIST_CONSOLE=tty` when
the launcher's console is a terminal (`console_env`: `fit` then shows progress), the chosen Python
environment, `GLIBC_TUNABLES` asking for huge pages (`contract.process_defaults`: not when the
launcher's environment or `--env` sets it or TPUDIST_HUGEPAGES=0) and finally the user's `--env`
values. `--dry-run` prints exactly this plan.

    plan = build_plan(config.procs, cluster, Ports(coordinator=8476, master=29500), job_id="ab12")
    print(plan_json(plan))   # {"processes": [{"host": ..., "rank": 0, "argv": [...], "env": {...}}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping

import tpudist.contract as contract
from tpudist.launch.config import JobOptions, ProcessOptions
from tpudist.launch.clusters import Cluster, Host


@dataclasses.dataclass(frozen=True)
class Ports:
    """The two ports rank 0's host serves: the JAX coordinator and torch's MASTER_PORT."""

    coordinator: int
    master: int


@dataclasses.dataclass(frozen=True)
class PythonEnv:
    """Where the agent's and the processes' Python comes from on every host."""

    interpreter: str  # runs the agent: the launcher's own, --python, or --venv's
    path_prepend: tuple[str, ...] = ()  # put first on the processes' PATH, so `python` means this one
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. VIRTUAL_ENV
    conda_env: str | None = None  # processes run inside this conda environment


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """One process of the job."""

    host: Host
    worker: int
    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]  # set on top of the host's login environment
    path_prepend: tuple[str, ...]
    cwd: str
    conda_env: str | None
    slice: int = 0  # the slice of the job this process belongs to

    def to_json(self) -> dict:
        return {"host": str(self.host), "worker": self.worker, "slice": self.slice, "rank": self.rank,
                "local_rank": self.local_rank, "argv": list(self.argv), "env": dict(self.env),
                "path_prepend": list(self.path_prepend), "cwd": self.cwd, "conda_env": self.conda_env}


def python_env(procs: ProcessOptions) -> PythonEnv:
    """The Python environment chosen by --venv / --conda-env / --python (default: the launcher's)."""
    if procs.venv:
        venv = os.path.abspath(os.path.expanduser(procs.venv))
        bin_dir = os.path.join(venv, "bin")
        return PythonEnv(procs.python or os.path.join(bin_dir, "python"), (bin_dir,), {"VIRTUAL_ENV": venv})
    interpreter = procs.python or sys.executable
    if procs.conda_env:  # the env's activation puts its own bin first; the agent still needs tpudist
        return PythonEnv(interpreter, conda_env=procs.conda_env)
    # Not os.path.realpath: a venv's bin/python is a symlink, and its bin directory is the one to use.
    return PythonEnv(interpreter, (os.path.dirname(interpreter),))


def processes_per_host(procs: ProcessOptions, cluster: Cluster) -> list[int]:
    """How many processes each worker runs: --nproc-per-host, else slots, else the TPU's, else 1."""
    if procs.nproc_per_host:
        return [procs.nproc_per_host] * len(cluster.hosts)
    default = 1
    if cluster.accelerator_type:
        from tpudist.launch import tpu  # only needed on a TPU
        default = tpu.default_nproc_per_host(cluster)
    return [host.slots or default for host in cluster.hosts]


def process_slices(cluster: Cluster, counts: list[int]) -> list[int]:
    """Each rank's slice: ranks are slice-major and every slice has W / S of the W processes.

    Hosts belong to slices in contiguous blocks (`cluster.host_slices`); a one-host cluster with
    S slices splits its processes (`--local --nproc-per-host 4 --num-slices 2`: 0-1 and 2-3).
    Raises ValueError showing the arithmetic when the processes do not split into equal slices.
    """
    slices, world = cluster.num_slices, sum(counts)
    if slices == 1:
        return [0] * world
    if world % slices:
        raise ValueError(f"{world} processes do not split into {slices} slices of equal size "
                         f"({world} / {slices} is not whole); every slice runs the same number of "
                         "processes: change --nproc-per-host or the slice count")
    per = world // slices
    by_rank = [r // per for r in range(world)]
    if cluster.host_slices:
        sizes = [0] * slices
        for n, s in zip(counts, cluster.host_slices):
            sizes[s] += n
        if len(set(sizes)) > 1:
            shown = ", ".join(f"slice {s}: {n}" for s, n in enumerate(sizes))
            raise ValueError(f"the slices have different numbers of processes ({shown}); every slice "
                             f"must run {world} / {slices} = {per}: change the slots or --nproc-per-host")
        by_rank = [s for n, s in zip(counts, cluster.host_slices) for _ in range(n)]
    return by_rank


def slice_env(num_slices: int, slice_id: int, coordinator_ip: str) -> dict[str, str]:
    """The MEGASCALE_* variables of a process in slice `slice_id` (none for a single slice)."""
    if num_slices == 1:
        return {}
    return {contract.NUM_SLICES: str(num_slices), contract.SLICE_ID: str(slice_id),
            contract.SLICE_COORDINATOR: coordinator_ip, contract.SLICE_PORT: str(contract.DEFAULT_SLICE_PORT)}


def console_is_terminal(quiet: bool) -> bool:
    """Whether the launcher's console (stdout and stderr) is a terminal someone watches, not --quiet."""
    return sys.stdout.isatty() and sys.stderr.isatty() and not quiet


def console_env(terminal: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """TPUDIST_CONSOLE for every process, on every host alike: the launcher's own value when its
    environment (`environ`) sets one, as the user's choice (`""`: no progress by default) or an outer
    launcher's whose console this one's lines reach; else "tty" when `terminal`; else nothing.
    `--env TPUDIST_CONSOLE=...` wins over both, as every --env value does."""
    if contract.CONSOLE in environ:
        return {contract.CONSOLE: environ[contract.CONSOLE]}
    return {contract.CONSOLE: "tty"} if terminal else {}


def host_profile_dir(job_id: str, worker: int) -> str:
    """Where host `worker`'s processes write their traces under --profile (copied back at the end)."""
    return f"/tmp/tpudist-profile-{job_id}-w{worker}"


def coordinator_host(cluster: Cluster, ssh_config_hostname: str | None = None) -> str:
    """The address every process uses to reach rank 0's host."""
    if cluster.local:
        return "127.0.0.1"
    host = cluster.hosts[0]
    return host.internal_ip or ssh_config_hostname or host.address


def jax_coordinator_for(cluster: Cluster, *, job_id: str, attempt: int, worker: int) -> str:
    """Where `worker`'s processes reach the JAX coordinator rank 0 serves: a Unix socket only the
    job's user can open (JAX's coordinator takes no secret: tpudist/_coordinator.py). On a multi-host
    job each host has its own: worker 0's is rank 0's, the others' are their agent's relay to worker
    0's gate (`gate_address`)."""
    private = contract.PRIVATE_DIR_TOKEN  # each host's agent puts the user's private directory there
    if len(cluster.hosts) == 1:
        return f"unix:{private}/tpudist-{job_id}-{attempt}.sock"
    return f"unix:{private}/tpudist-{job_id}-{attempt}-w{worker}.sock"


def gate_address(cluster: Cluster, addr: str, port: int) -> dict[str, str]:
    """TPUDIST_COORDINATOR_GATE on a multi-host job: worker 0's agent admits the job's own hosts to
    the coordinator at rank 0's host and `port` (tpudist/launch/agent/_gate.py)."""
    return {} if len(cluster.hosts) == 1 else {contract.COORDINATOR_GATE: f"{_bracket(addr)}:{port}"}


_LIBTPU_PORTS = (8476, 8476 + 64)


def choose_ports(job: JobOptions, probed: list[int]) -> Ports:
    """--coordinator-port/--master-port, else ports probed free on rank 0's host."""
    # libtpu serves 8476 + local rank on every worker (TPU_PROCESS_PORT): never hand those out.
    probed = [p for p in probed if p not in (job.coordinator_port, job.master_port)
              and not _LIBTPU_PORTS[0] <= p < _LIBTPU_PORTS[1]]
    coordinator = job.coordinator_port or probed.pop(0)
    master = job.master_port or probed.pop(0)
    return Ports(coordinator, master)


def build_plan(procs: ProcessOptions, cluster: Cluster, ports: Ports, *, job_id: str, attempt: int = 0,
               coordinator: str | None = None,
               stop_grace: float = contract.DEFAULT_STOP_GRACE, console: bool = False) -> list[ProcessPlan]:
    """Every process of the job, in rank order (`stop_grace`: --stop-grace, which processes see;
    `console`: the launcher's console is a terminal, `console_is_terminal`)."""
    counts = processes_per_host(procs, cluster)
    world_size = sum(counts)
    slices = process_slices(cluster, counts)
    addr = coordinator or coordinator_host(cluster)
    pyenv = python_env(procs)
    platform = procs.platform or ("tpu" if cluster.accelerator_type else "cpu" if procs.cpu_devices else None)
    cwd = procs.cwd
    plan = []
    rank = 0
    for worker, (host, nproc) in enumerate(zip(cluster.hosts, counts)):
        jax_coordinator = jax_coordinator_for(cluster, job_id=job_id, attempt=attempt, worker=worker)
        for local_rank in range(nproc):
            env = contract.JobEnv(
                rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=nproc,
                coordinator=jax_coordinator, master_addr=addr,
                master_port=ports.master, worker=worker, num_workers=len(cluster.hosts),
                host=host.address, cpu_devices=procs.cpu_devices, platform=platform, job_id=job_id,
                restart=attempt, stop_grace=stop_grace).to_environ()
            if cluster.accelerator_type:
                from tpudist.launch import tpu
                env.update(tpu.tpu_process_env(cluster, worker, local_rank, nproc))
            env.update(gate_address(cluster, addr, ports.coordinator))
            env.update(slice_env(cluster.num_slices, slices[rank], addr))
            env.update(contract.torchrun_environ(worker=worker, num_workers=len(cluster.hosts)))
            env.update(contract.jax_environ(coordinator=jax_coordinator, world_size=world_size, rank=rank,
                                            local_rank=local_rank, cpu_devices=procs.cpu_devices,
                                            environs=(os.environ, procs.env)))
            if procs.profile_dir:
                env[contract.PROFILE_DIR] = host_profile_dir(job_id, worker)
                env[contract.PROFILE_STEPS] = "%d:%d" % procs.profile_steps
            env["PYTHONUNBUFFERED"] = "1"
            env.update(console_env(console, os.environ))
            env.update(pyenv.env)
            env.update(contract.process_defaults(os.environ, procs.env))
            env.update(procs.env)
            plan.append(ProcessPlan(host, worker, rank, local_rank, procs.command, env,
                                    pyenv.path_prepend, cwd, pyenv.conda_env, slices[rank]))
            rank += 1
    return plan


def plan_json(plan: list[ProcessPlan]) -> str:
    """The `--dry-run` output: `{"processes": [{"host", "worker", "slice", "rank", "argv", "env", ...}]}`,
    the value of every variable whose name looks secret shown as "<hidden>" (`_env.looks_secret`)."""
    from tpudist.launch._env import masked

    shown = [{**p.to_json(), "env": masked(p.env)} for p in plan]
    return json.dumps({"processes": shown}, indent=2, ensure_ascii=False)


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
