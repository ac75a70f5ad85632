"""The environment contract between the launcher and the runtime.

Every variable that `python -m tpudist.xla_dist` or `tpudist.spawn` sets for a process, and that
`tpudist.init()` reads, is declared here once. Both sides import this module; nothing else spells
these names.

The torch-compatible names (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`) mean what `torch.distributed` expects, so that
`torch.distributed.init_process_group("gloo", init_method="env://")` works inside a tpudist job.
`MASTER_PORT` is always a different port from the JAX coordinator's.

Slices: a job may span several slices joined over DCN. The `MEGASCALE_*` names are libtpu's, as
xpk / JobSet manifests and Ray's TPU launcher set them; ranks are slice-major, so slice s holds
ranks `[s * P, (s + 1) * P)` with `P = WORLD_SIZE / MEGASCALE_NUM_SLICES`. A single-slice job sets
none of them. On TPU each device also knows its slice (`device.slice_index`); on a CPU mesh, where
devices do not, `MEGASCALE_NUM_SLICES` alone emulates slices by grouping the processes that way,
and a device's slice is its process's (`tpudist.slice_index`, `tpudist.mesh.make_mesh(..., dcn=...)`).

Other launchers' names: the launcher also sets what lets a program written for JAX alone join the
job with `jax.distributed.initialize()` and no arguments (`jax_environ`); tpudist's runtime never
reads those.

Example::

    env = JobEnv(rank=1, world_size=4, local_rank=1, local_world_size=2,
                 coordinator="10.0.0.2:8476", master_addr="10.0.0.2", master_port=29500)
    os.environ.update(env.to_environ())
    assert JobEnv.from_environ(os.environ) == env
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# Torch-compatible names.
RANK = "RANK"  # this process's index in the job, 0..WORLD_SIZE-1 (= jax.process_index())
WORLD_SIZE = "WORLD_SIZE"  # number of processes in the job (= jax.process_count())
LOCAL_RANK = "LOCAL_RANK"  # this process's index among the processes of its host
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # number of processes on this host
MASTER_ADDR = "MASTER_ADDR"  # address of rank 0's host, for torch.distributed's env:// rendezvous
MASTER_PORT = "MASTER_PORT"  # torch.distributed's rendezvous port (never the JAX coordinator's)

# tpudist's own names.
# host:port of the JAX distributed coordinator (served by rank 0); in a launched job a Unix socket only
# the job's user can open, `unix:<private>/tpudist-<job>-<attempt>[-w<worker>].sock`, in the user's private
# directory on each host (`$XDG_RUNTIME_DIR/tpudist` or `/tmp/tpudist-<uid>`, 0700: tpudist/_coordinator.py)
COORDINATOR = "TPUDIST_COORDINATOR"
# In the plan's addresses the private directory is this token; each host's agent resolves it before
# its processes start (a process never sees it).
PRIVATE_DIR_TOKEN = "${TPUDIST_PRIVATE_DIR}"
# host:port of worker 0's coordinator gate on a multi-host job, which the agents relay the other
# hosts' coordinator sockets to (tpudist/launch/agent/_gate.py); the processes need not read it
COORDINATOR_GATE = "TPUDIST_COORDINATOR_GATE"
WORKER = "TPUDIST_WORKER"  # index of this process's host in the job (the TPU worker id on a slice)
NUM_WORKERS = "TPUDIST_NUM_WORKERS"  # number of hosts in the job
HOST = "TPUDIST_HOST"  # the host name the launcher used to reach this host (for messages)
CPU_DEVICES = "TPUDIST_CPU_DEVICES"  # XLA CPU devices per process on a CPU mesh (unset: platform default)
PLATFORM = "TPUDIST_PLATFORM"  # "cpu", "tpu", "gpu"; unset lets JAX choose
JOB_ID = "TPUDIST_JOB_ID"  # a random id naming this job (in key-value store keys and log files)
INIT_TIMEOUT = "TPUDIST_INIT_TIMEOUT"  # seconds tpudist.init() waits for every process to join
COLLECTIVE_TIMEOUT = "TPUDIST_COLLECTIVE_TIMEOUT"  # seconds an eager collective waits for its peers
CACHE_DIR = "TPUDIST_CACHE_DIR"  # persistent compilation cache directory ("off" disables it)
RESTART = "TPUDIST_RESTART"  # which attempt of the job this is (0 first), under --max-restarts
STOP_GRACE = "TPUDIST_STOP_GRACE"  # seconds between the SIGTERM that stops a process and SIGKILL
CONSOLE = "TPUDIST_CONSOLE"  # "tty": the launcher's console is a terminal (fit then shows progress lines)

TORCH_HOST_VIEW = "TPUDIST_TORCH_HOST_VIEW"  # "0": the fused step and compiled modules copy between torch and XLA even on CPU (as on a TPU)
GRAD_BUCKET_MB = "TPUDIST_GRAD_BUCKET_MB"  # the data-parallel step's bucket for small gradients, MiB (1; 0: one all-reduce per array)
HUGEPAGES = "TPUDIST_HUGEPAGES"  # "0": do not set GLIBC_TUNABLES for the processes tpudist starts
# fit's goodput so far, one line on rank 0's stderr under the launcher (its JSON after this prefix):
# the agent files it as chatter (log files, -v), the launcher sums the attempts' into the job's goodput
GOODPUT_REPORT = "tpudist-goodput "
PEAK_FLOPS = "TPUDIST_PEAK_FLOPS"  # one device's peak FLOP/s for MFU where tpudist's table has none (a CPU)

# Slices (libtpu's names, as xpk / JobSet and Ray's TPU launcher set them). Unset: one slice.
NUM_SLICES = "MEGASCALE_NUM_SLICES"  # slices in the job; WORLD_SIZE / NUM_SLICES processes each
SLICE_ID = "MEGASCALE_SLICE_ID"  # this process's slice, RANK // (WORLD_SIZE / NUM_SLICES)
SLICE_COORDINATOR = "MEGASCALE_COORDINATOR_ADDRESS"  # slice 0 worker 0's internal IP (no port)
SLICE_PORT = "MEGASCALE_PORT"  # the port libtpu's DCN coordinator uses there
DEFAULT_SLICE_PORT = 8081  # Ray's `get_tpu_coordinator_env_vars` default, as on GKE

# Profiling (`--profile DIR --profile-steps A:B`): `fit` traces steps A..B-1 (0-based, B exclusive)
# into PROFILE_DIR/rank<RANK>/ on each host, which the launcher copies back to DIR when the job ends.
PROFILE_DIR = "TPUDIST_PROFILE_DIR"  # this host's directory for the traces (job-specific, under /tmp)
PROFILE_STEPS = "TPUDIST_PROFILE_STEPS"  # "A:B": the steps of fit to trace

# Hangs: each host's agent gives each process a private directory of its own; `tpudist.init()` puts
# its stack dumper's output and its progress record there (tpudist/_stacks.py), which the agent
# reads when the launcher asks for every rank's stacks (--hang-timeout, SIGQUIT).
DEBUG_DIR = "TPUDIST_DEBUG_DIR"
# The agent's startup hook (tpudist/_hook/sitecustomize.py), first on PYTHONPATH of each process it
# starts: it installs the stack dumper in any Python program, tpudist or not. "0": leave it out (the
# stacks then come only from programs that call tpudist.init()).
STARTUP_HOOK = "TPUDIST_STARTUP_HOOK"

# The TPU preflight (`tpudist doctor`, and each host's agent before a job starts): where the TPU's
# device nodes and libtpu's lock file are. Overridable for tests (stand-in paths); the launcher
# reads them from --env, then its own environment, and passes them to every host's agent.
TPU_DEVICES = "TPUDIST_TPU_DEVICES"  # ":"-separated globs of the TPU device nodes
LIBTPU_LOCKFILE = "TPUDIST_LIBTPU_LOCKFILE"  # libtpu's lock file
DEFAULT_TPU_DEVICES = "/dev/accel*:/dev/vfio/[0-9]*"  # v2-v5p: /dev/accel<N>; v5e, v6e: VFIO groups
DEFAULT_LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"

# What `jax.distributed.initialize()` without arguments reads (jax 0.10: jax/_src/distributed.py
# and jax/_src/clusters/). Off a TPU VM, JAX finds the process count and index only through a
# cluster it recognises; the launcher describes the job as Open MPI's `mpirun` would (the
# variables of jax/_src/clusters/ompi_cluster.py), with the coordinator named explicitly.
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # = COORDINATOR
JAX_COORDINATOR_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"  # = COORDINATOR when that is a unix: socket
JAX_NUM_CPU_DEVICES = "JAX_NUM_CPU_DEVICES"  # = CPU_DEVICES, for a JAX program's own CPU backend
OMPI_HNP_URI = "OMPI_MCA_orte_hnp_uri"  # its presence is JAX's "launched by mpirun" test
OMPI_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"  # = WORLD_SIZE
OMPI_WORLD_RANK = "OMPI_COMM_WORLD_RANK"  # = RANK
OMPI_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"  # = LOCAL_RANK
JAX_AUTODETECT = "TPUDIST_JAX_AUTODETECT"  # "0": do not set the OMPI_* variables above

# A TPU slice as GKE describes it to each pod (and the launcher to each TPU process): `tpudist.init()`
# with none of the launcher's variables set joins the job these describe (tpudist/_gke.py), as
# jax/_src/clusters/cloud_tpu_cluster.py's GkeTpuCluster reads them. One process per worker; worker
# list in worker order; a multislice job adds the MEGASCALE_* variables above.
TPU_WORKER_ID = "TPU_WORKER_ID"  # this worker's index in its slice
TPU_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"  # the slice's workers, comma-separated, worker order
TPU_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"  # host:port of every TPU process (wins, as in JAX)
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # a pod's index in its Indexed Job (JobSet: a Job per slice)
COORDINATOR_PORT = "TPUDIST_COORDINATOR_PORT"  # the JAX coordinator's port when init() derives it
DEFAULT_COORDINATOR_PORT = 8482  # JAX's own on Cloud TPU and GKE (cloud_tpu_cluster.coordinator_port)

# TorchTPU (`torch_tpu`): what its multi-host wrapper (torch_tpu/_internal/distributed/launchers/
# multihost_wrapper) derives from TPU_WORKER_HOSTNAMES and JOB_COMPLETION_INDEX for torchrun, which the
# launcher sets itself on a TPU slice (tpudist/launch/tpu/env.py) so that nothing is left to derive.
NNODES = "NNODES"  # hosts in the job (torchrun --nnodes)
NODE_RANK = "NODE_RANK"  # this host's index in the job (torchrun --node-rank)
TORCH_TPU_TOPOLOGY = "TORCH_TPU_TOPOLOGY"  # the slice's chips along each axis: "2,2,4" (tpu7x: ",2")
TORCH_TPU_SLICEBUILDER_ADDRESSES = "TORCH_TPU_SLICEBUILDER_ADDRESSES"  # host:port per device, worker order
TORCH_TPU_BASE_PORT = "TORCH_TPU_BASE_PORT"  # device d of a worker serves slice building on base + d
TORCH_TPU_DEVICES_PER_HOST = "TORCH_TPU_DEVICES_PER_HOST"  # TorchTPU devices (processes) per worker
DEFAULT_TORCH_TPU_BASE_PORT = 8070  # the wrapper's default

# Set for every process tpudist starts unless the user's environment names it (or HUGEPAGES=0):
# transparent huge pages for glibc's large allocations. XLA:CPU allocates each output buffer afresh,
# and where the kernel gives huge pages only on request (THP "madvise", the common default) every
# use of a 64 MiB buffer took 16k page faults; a 64 MiB all_reduce over 2 processes went from 170 to
# 117 ms with it (docs/collectives.md). glibc before 2.35 ignores it.
GLIBC_TUNABLES = "GLIBC_TUNABLES"
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"

DEFAULT_INIT_TIMEOUT = 300.0
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
DEFAULT_STOP_GRACE = 3.0

ALL = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, COORDINATOR,
       WORKER, NUM_WORKERS, HOST, CPU_DEVICES, PLATFORM, JOB_ID, INIT_TIMEOUT, COLLECTIVE_TIMEOUT,
       CACHE_DIR, RESTART, STOP_GRACE, HUGEPAGES, NUM_SLICES, SLICE_ID, SLICE_COORDINATOR, SLICE_PORT,
       PROFILE_DIR, PROFILE_STEPS, TPU_DEVICES, LIBTPU_LOCKFILE, JAX_AUTODETECT, DEBUG_DIR, STARTUP_HOOK,
       COORDINATOR_PORT, COORDINATOR_GATE, CONSOLE)


def process_defaults(*environs: Mapping[str, str]) -> dict[str, str]:
    """Variables for a process tpudist starts that none of `environs` (the user's) sets:
    GLIBC_TUNABLES asking glibc for huge pages, unless TPUDIST_HUGEPAGES=0."""
    if any(GLIBC_TUNABLES in e or e.get(HUGEPAGES) == "0" for e in environs):
        return {}
    return {GLIBC_TUNABLES: HUGEPAGE_TUNABLE}


def jax_environ(*, coordinator: str, world_size: int, rank: int, local_rank: int,
                cpu_devices: int | None, environs: tuple[Mapping[str, str], ...] = ()) -> dict[str, str]:
    """What lets `jax.distributed.initialize()` with no arguments join this job (see above).

    The Open MPI variables are left out when one of `environs` (the user's) has
    TPUDIST_JAX_AUTODETECT=0, for a program that uses a real MPI library. The local rank they carry
    makes JAX (off a TPU VM) restrict each process to GPU `LOCAL_RANK`, as under `mpirun`.
    """
    env = {JAX_COORDINATOR_ADDRESS: coordinator}
    if coordinator.startswith("unix:"):  # JAX's default, "[::]:" + what follows the last ":", is no socket
        env[JAX_COORDINATOR_BIND_ADDRESS] = coordinator
    if cpu_devices is not None:
        env[JAX_NUM_CPU_DEVICES] = str(cpu_devices)
    if not any(e.get(JAX_AUTODETECT) == "0" for e in environs):
        host = coordinator.rsplit(":", 1)[0]
        env.update({
            # jax parses `<jobid>.<vpid>;tcp://<ip>:<port>` only when JAX_COORDINATOR_ADDRESS is unset
            OMPI_HNP_URI: f"0.0;{'tcp6' if host.startswith('[') else 'tcp'}://{coordinator}",
            OMPI_WORLD_SIZE: str(world_size), OMPI_WORLD_RANK: str(rank), OMPI_LOCAL_RANK: str(local_rank),
        })
    return env


def torchrun_environ(*, worker: int, num_workers: int) -> dict[str, str]:
    """torchrun's host count and host index, for a program that runs `torchrun --nnodes $NNODES
    --node-rank $NODE_RANK ...` on each host (as TorchTPU's multi-host wrapper has it do)."""
    return {NNODES: str(num_workers), NODE_RANK: str(worker)}


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _float(environ: Mapping[str, str], name: str, default: float, zero_ok: bool = False) -> float:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    return value


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """One process's view of its job, as the launcher writes it and the runtime reads it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    coordinator: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    worker: int = 0
    num_workers: int = 1
    host: str | None = None
    cpu_devices: int | None = None
    platform: str | None = None
    job_id: str | None = None
    init_timeout: float = DEFAULT_INIT_TIMEOUT
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    restart: int = 0
    stop_grace: float = DEFAULT_STOP_GRACE
    num_slices: int = 1
    slice_id: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"{WORLD_SIZE}={self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{RANK}={self.rank} must be in [0, {WORLD_SIZE}={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"{LOCAL_RANK}={self.local_rank} must be in "
                             f"[0, {LOCAL_WORLD_SIZE}={self.local_world_size})")
        if self.world_size > 1 and not self.coordinator:
            raise ValueError(f"{WORLD_SIZE}={self.world_size} but {COORDINATOR} is not set; start "
                             "multi-process jobs with `python -m tpudist.xla_dist` or tpudist.spawn")
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ValueError(f"{CPU_DEVICES}={self.cpu_devices} must be at least 1")
        if self.num_slices < 1 or self.world_size % self.num_slices:
            raise ValueError(f"{NUM_SLICES}={self.num_slices} must be a positive divisor of "
                             f"{WORLD_SIZE}={self.world_size}: every slice has the same number of "
                             "processes")
        if self.slice_id is not None and self.slice_id != self.slice_of(self.rank):
            raise ValueError(f"{SLICE_ID}={self.slice_id} but {RANK}={self.rank} is in slice "
                             f"{self.slice_of(self.rank)}: ranks are slice-major, "
                             f"{self.world_size // self.num_slices} processes per slice")

    def slice_of(self, rank: int) -> int:
        """The slice that process `rank` belongs to: ranks are slice-major, equal slices."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"process {rank} is not in a job of {WORLD_SIZE}={self.world_size}")
        return rank // (self.world_size // self.num_slices)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "JobEnv":
        """Reads the contract; unset variables mean a single-process job on this machine."""
        return cls(
            rank=_int(environ, RANK, 0),
            world_size=_int(environ, WORLD_SIZE, 1),
            local_rank=_int(environ, LOCAL_RANK, 0),
            local_world_size=_int(environ, LOCAL_WORLD_SIZE, 1),
            coordinator=environ.get(COORDINATOR) or None,
            master_addr=environ.get(MASTER_ADDR) or None,
            master_port=_int(environ, MASTER_PORT),
            worker=_int(environ, WORKER, 0),
            num_workers=_int(environ, NUM_WORKERS, 1),
            host=environ.get(HOST) or None,
            cpu_devices=_int(environ, CPU_DEVICES),
            platform=environ.get(PLATFORM) or None,
            job_id=environ.get(JOB_ID) or None,
            init_timeout=_float(environ, INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT),
            collective_timeout=_float(environ, COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT),
            restart=_int(environ, RESTART, 0),
            stop_grace=_float(environ, STOP_GRACE, DEFAULT_STOP_GRACE, zero_ok=True),
            num_slices=_int(environ, NUM_SLICES, 1),
            slice_id=_int(environ, SLICE_ID),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables to set for this process (unset fields are left out)."""
        values = {
            RANK: self.rank, WORLD_SIZE: self.world_size, LOCAL_RANK: self.local_rank,
            LOCAL_WORLD_SIZE: self.local_world_size, COORDINATOR: self.coordinator,
            MASTER_ADDR: self.master_addr, MASTER_PORT: self.master_port, WORKER: self.worker,
            NUM_WORKERS: self.num_workers, HOST: self.host, CPU_DEVICES: self.cpu_devices,
            PLATFORM: self.platform, JOB_ID: self.job_id, INIT_TIMEOUT: self.init_timeout,
            COLLECTIVE_TIMEOUT: self.collective_timeout, RESTART: self.restart, STOP_GRACE: self.stop_grace,
            # A single-slice job sets no MEGASCALE_* variable: libtpu reads them.
            NUM_SLICES: self.num_slices if self.num_slices > 1 else None,
            SLICE_ID: self.slice_id if self.num_slices > 1 else None,
        }
        return {k: str(v) for k, v in values.items() if v is not None}
