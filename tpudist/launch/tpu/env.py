"""The TPU runtime's environment for every worker and every process of a slice.

libtpu (under JAX or torch_xla) on each worker must see the same picture of the slice, and each
process its own place in it. This module computes that picture from a resolved `Cluster` (hosts in
worker order, accelerator type, topology, and the metadata server's `tpu-env` when the launcher
runs on a TPU VM) and the table in `topology.py` next to this module. Values from `tpu-env` win
over the table.

Two modes:

- One process per worker (the default): PJRT in that process drives all of the worker's chips.
  Every process gets `TPU_WORKER_ID`, `TPU_WORKER_HOSTNAMES`, `TPU_ACCELERATOR_TYPE`,
  `TPU_TOPOLOGY`, `TPU_HOST_BOUNDS`, `TPU_CHIPS_PER_HOST_BOUNDS` and `PJRT_DEVICE=TPU`; and
  TorchTPU's: `JOB_COMPLETION_INDEX` (the worker), `TORCH_TPU_TOPOLOGY`,
  `TORCH_TPU_SLICEBUILDER_ADDRESSES` (every worker's address with ports 8070.. per TorchTPU
  device), `TORCH_TPU_BASE_PORT`, `TORCH_TPU_DEVICES_PER_HOST` (`contract.py` spells those).
- One process per chip (`--nproc-per-host N` with N = chips per worker), torch_xla's multiprocess
  layout: in addition `TPU_PROCESS_BOUNDS` (host bounds times chips-per-host bounds, axis by axis),
  `TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1`, `TPU_VISIBLE_CHIPS=<local rank>`,
  `TPU_PROCESS_PORT=8476+<local rank>`, `TPU_PROCESS_ADDRESSES` (every worker's ip:port for every
  local rank, worker order) and `CLOUD_TPU_TASK_ID=worker*N+local_rank`.

Any other process count per worker is refused: libtpu cannot split a worker's chips unevenly.

A job over several slices (`Cluster.slices`) gives each slice its own picture: a process's
`TPU_WORKER_ID` is its worker's index in its slice and `TPU_WORKER_HOSTNAMES` lists that slice's
workers; `worker` arguments below count hosts across the job, slice-major.

The names below are Google's contract (libtpu, JAX's and torch_xla's TPU code read them), not
tpudist's own, which `tpudist/contract.py` declares; they are spelled here once, and only here.

Example (torch_xla's own test case: v4-16, 4 processes per worker, worker 1, local rank 0)::

    env = tpu_process_env(cluster, worker=1, local_rank=0, nproc_per_host=4)
    env["CLOUD_TPU_TASK_ID"], env["TPU_PROCESS_PORT"], env["TPU_PROCESS_BOUNDS"]
    # ('4', '8476', '2,2,2')
"""

from __future__ import annotations

import dataclasses

import tpudist.contract as contract
from tpudist.contract import TPU_PROCESS_ADDRESSES, TPU_WORKER_HOSTNAMES, TPU_WORKER_ID
from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.tpu.topology import SliceTopology, bounds_str, from_bounds, slice_topology

# --- Google's TPU runtime variables ------------------------------------------------------------
# TPU_WORKER_ID, TPU_WORKER_HOSTNAMES and TPU_PROCESS_ADDRESSES are in tpudist.contract, since
# `tpudist.init()` reads them too (a job GKE started).
TPU_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"  # "v4-32"
TPU_TOPOLOGY = "TPU_TOPOLOGY"  # "2x2x4", as GKE sets it
TPU_HOST_BOUNDS = "TPU_HOST_BOUNDS"  # workers along each axis: "1,1,4"
TPU_CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"  # one worker's chips along each axis
TPU_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"  # processes along each axis (one-process-per-chip mode)
TPU_CHIPS_PER_PROCESS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"  # one process's chips: "1,1,1"
TPU_VISIBLE_CHIPS = "TPU_VISIBLE_CHIPS"  # which of this worker's chips the process drives
TPU_PROCESS_PORT = "TPU_PROCESS_PORT"  # this process's libtpu port
CLOUD_TPU_TASK_ID = "CLOUD_TPU_TASK_ID"  # this process's index among all TPU processes
PJRT_DEVICE = "PJRT_DEVICE"  # torch_xla's device selector

ALL = (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_HOST_BOUNDS,
       TPU_CHIPS_PER_HOST_BOUNDS, TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS,
       TPU_VISIBLE_CHIPS, TPU_PROCESS_PORT, TPU_PROCESS_ADDRESSES, CLOUD_TPU_TASK_ID, PJRT_DEVICE)

# torch_xla's base port for per-chip processes: local rank r listens on 8476 + r.
TPU_PROCESS_BASE_PORT = 8476
# JAX's port for its distributed coordinator on a Cloud TPU (jax/_src/clusters/cloud_tpu_cluster).
JAX_COORDINATOR_PORT = contract.DEFAULT_COORDINATOR_PORT
# TorchTPU devices per chip: tpu7x chips are two devices (chiplets), which TorchTPU's topology
# counts as a fourth axis ("2,2,1,2"; torchtitan's experiments/tpu/cloud_distributed_utils.py).
_TORCH_TPU_DEVICES_PER_CHIP = {"7x": 2}

# The metadata server's `tpu-env` keys for the facts the table also knows.
_TPU_ENV_ACCELERATOR_TYPE = "ACCELERATOR_TYPE"
_TPU_ENV_TOPOLOGY = "TOPOLOGY"
_TPU_ENV_HOST_BOUNDS = "HOST_BOUNDS"
_TPU_ENV_CHIPS_PER_HOST_BOUNDS = "CHIPS_PER_HOST_BOUNDS"


def cluster_slice(cluster: Cluster) -> SliceTopology:
    """The slice a cluster runs on, `tpu-env` values winning over the table.

    Raises ValueError when the cluster has no TPU accelerator type, or when the slice has a
    different number of workers than the cluster has hosts (every worker must run the program,
    or libtpu waits for the missing ones forever). A multislice cluster checks every slice and
    answers for slice 0 (they are alike).
    """
    if cluster.slices:
        return [cluster_slice(c) for c in cluster.slices][0]
    tpu_env = cluster.tpu_env
    accelerator_type = tpu_env.get(_TPU_ENV_ACCELERATOR_TYPE) or cluster.accelerator_type
    if not accelerator_type:
        raise ValueError(f"the {cluster.source!r} cluster has no TPU accelerator type; the TPU "
                         "environment is only for --tpu slices (or pass --tpu=local on a TPU VM)")
    topology = tpu_env.get(_TPU_ENV_TOPOLOGY) or cluster.topology
    chip_bounds = tpu_env.get(_TPU_ENV_CHIPS_PER_HOST_BOUNDS)
    host_bounds = tpu_env.get(_TPU_ENV_HOST_BOUNDS)
    if chip_bounds and host_bounds:
        tpu = from_bounds(accelerator_type, chip_bounds, host_bounds, topology)
    else:
        tpu = slice_topology(accelerator_type, topology)
        if chip_bounds or host_bounds:  # only one of the two in tpu-env: it still wins
            tpu = from_bounds(accelerator_type,
                              chip_bounds or bounds_str(tpu.chips_per_host_bounds),
                              host_bounds or bounds_str(tpu.host_bounds), topology)
    if tpu.workers != len(cluster.hosts):
        shown = ", ".join(str(h) for h in cluster.hosts[:8]) + (", ..." if len(cluster.hosts) > 8
                                                                 else "")
        raise ValueError(
            f"TPU {tpu.accelerator_type} (topology {tpu.topology}, host bounds "
            f"{bounds_str(tpu.host_bounds)}) has {tpu.workers} workers, but the {cluster.source!r} "
            f"source found {len(cluster.hosts)} hosts ({shown}); a slice runs on all of its "
            "workers. Check that the TPU name and zone are right and the slice is fully created.")
    return tpu


def default_nproc_per_host(cluster: Cluster) -> int:
    """Processes per worker when `--nproc-per-host` is not given: 1 (PJRT drives every chip).

    Validates the cluster's slice first, so a bad slice fails before anything starts.
    """
    cluster_slice(cluster)
    return 1


def check_nproc_per_host(cluster: Cluster, nproc_per_host: int | None) -> int:
    """The number of processes per worker, validated: None -> 1; 1 or chips-per-worker -> itself.

    Raises ValueError for any other count, naming the two that work.
    """
    tpu = cluster_slice(cluster)
    if nproc_per_host is None:
        return default_nproc_per_host(cluster)
    if nproc_per_host in (1, tpu.chips_per_worker):
        return nproc_per_host
    raise ValueError(
        f"--nproc-per-host {nproc_per_host} does not fit TPU {tpu.accelerator_type}: each of its "
        f"{tpu.workers} workers has {tpu.chips_per_worker} chips, so run 1 process per worker "
        f"(the default: it drives all {tpu.chips_per_worker} chips) or {tpu.chips_per_worker} "
        "(one per chip)")


def worker_addresses(cluster: Cluster) -> list[str]:
    """Each worker's address for its peers, worker order: internal IP, else host name/address."""
    return [_peer_address(h) for h in cluster.hosts]


def coordinator_address(cluster: Cluster, nproc_per_host: int | None = None) -> str:
    """`ip:port` of the JAX distributed coordinator, on worker 0.

    The port is JAX's own choice on Cloud TPU (8482) unless one-process-per-chip mode's libtpu
    ports (8476, 8477, ...) reach it, in which case the first port after them.
    """
    if not cluster.hosts:
        raise ValueError(f"the {cluster.source!r} cluster has no hosts")
    port = max(JAX_COORDINATOR_PORT, TPU_PROCESS_BASE_PORT + (nproc_per_host or 1))
    return f"{_peer_address(cluster.hosts[0])}:{port}"


@dataclasses.dataclass(frozen=True)
class TpuLayout:
    """One slice's TPU environment, computed once and read per process.

    A pod has hundreds of workers; the strings every process shares (the worker list, the process
    addresses) are built here once instead of once per process.
    """

    slice: SliceTopology
    nproc_per_host: int  # 1, or the chips per worker (one process per chip)
    worker_addresses: tuple[str, ...]
    worker_hostnames: str  # TPU_WORKER_HOSTNAMES
    process_addresses: str  # TPU_PROCESS_ADDRESSES; "" with one process per worker
    slicebuilder_addresses: str  # TORCH_TPU_SLICEBUILDER_ADDRESSES

    def worker_env(self, worker: int) -> dict[str, str]:
        """The TPU variables every process on `worker` gets, in either mode: libtpu's, and
        TorchTPU's (what its multi-host wrapper would derive; `worker` in this slice is
        JobSet's `JOB_COMPLETION_INDEX`)."""
        tpu = self.slice
        if not 0 <= worker < tpu.workers:
            raise ValueError(f"worker {worker} is not in [0, {tpu.workers}) for TPU "
                             f"{tpu.accelerator_type}")
        return {
            TPU_WORKER_ID: str(worker),
            TPU_WORKER_HOSTNAMES: self.worker_hostnames,
            TPU_ACCELERATOR_TYPE: tpu.accelerator_type,
            TPU_TOPOLOGY: tpu.topology,
            TPU_HOST_BOUNDS: bounds_str(tpu.host_bounds),
            TPU_CHIPS_PER_HOST_BOUNDS: bounds_str(tpu.chips_per_host_bounds),
            PJRT_DEVICE: "TPU",
            contract.JOB_COMPLETION_INDEX: str(worker),
            contract.TORCH_TPU_TOPOLOGY: torch_tpu_topology(tpu),
            contract.TORCH_TPU_SLICEBUILDER_ADDRESSES: self.slicebuilder_addresses,
            contract.TORCH_TPU_BASE_PORT: str(contract.DEFAULT_TORCH_TPU_BASE_PORT),
            contract.TORCH_TPU_DEVICES_PER_HOST: str(torch_tpu_devices_per_worker(tpu)),
        }

    def process_env(self, worker: int, local_rank: int) -> dict[str, str]:
        """Every TPU variable for process `local_rank` of `worker`."""
        nproc = self.nproc_per_host
        if not 0 <= local_rank < nproc:
            raise ValueError(f"local rank {local_rank} is not in [0, {nproc}) on worker {worker}")
        env = self.worker_env(worker)
        if nproc == 1:
            return env
        tpu = self.slice
        process_bounds = [h * c for h, c in zip(tpu.host_bounds, tpu.chips_per_host_bounds)]
        env.update({
            TPU_PROCESS_BOUNDS: ",".join(str(b) for b in process_bounds),
            TPU_CHIPS_PER_PROCESS_BOUNDS: "1,1,1",
            TPU_VISIBLE_CHIPS: str(local_rank),
            TPU_PROCESS_PORT: str(TPU_PROCESS_BASE_PORT + local_rank),
            TPU_PROCESS_ADDRESSES: self.process_addresses,
            CLOUD_TPU_TASK_ID: str(worker * nproc + local_rank),
        })
        return env


# The last layout built, so that calling tpu_process_env once per process of a pod stays linear.
_last_layout: tuple[Cluster, TpuLayout] | None = None


def tpu_layout(cluster: Cluster, nproc_per_host: int | None) -> TpuLayout:
    """The slice's TPU environment for `nproc_per_host` processes per worker (None: 1).

    Raises ValueError for a bad slice (see `cluster_slice`) or process count (see
    `check_nproc_per_host`).
    """
    global _last_layout
    if _last_layout is not None and _last_layout[0] is cluster and \
            _last_layout[1].nproc_per_host == (nproc_per_host or 1):
        return _last_layout[1]
    nproc = check_nproc_per_host(cluster, nproc_per_host)
    addresses = tuple(worker_addresses(cluster))
    ports = [TPU_PROCESS_BASE_PORT + r for r in range(nproc)] if nproc > 1 else []
    tpu = cluster_slice(cluster)
    builders = [contract.DEFAULT_TORCH_TPU_BASE_PORT + d for d in range(torch_tpu_devices_per_worker(tpu))]
    layout = TpuLayout(
        slice=tpu, nproc_per_host=nproc, worker_addresses=addresses,
        worker_hostnames=",".join(addresses),
        process_addresses=",".join(f"{a}:{p}" for a in addresses for p in ports),
        slicebuilder_addresses=",".join(f"{a}:{p}" for a in addresses for p in builders))
    _last_layout = (cluster, layout)
    return layout


def locate(cluster: Cluster, worker: int) -> tuple[Cluster, int]:
    """The slice that host `worker` of the job belongs to, and its worker index there."""
    for part in cluster.slices:
        if worker < len(part.hosts):
            return part, worker
        worker -= len(part.hosts)
    if cluster.slices:
        raise ValueError(f"host {worker} is not in the {len(cluster.hosts)} hosts of the job")
    return cluster, worker


def worker_env(cluster: Cluster, worker: int) -> dict[str, str]:
    """The TPU variables every process on `worker` gets, in either mode."""
    part, worker = locate(cluster, worker)
    return tpu_layout(part, None).worker_env(worker)


def tpu_process_env(cluster: Cluster, worker: int, local_rank: int,
                    nproc_per_host: int | None) -> dict[str, str]:
    """Every TPU variable for process `local_rank` of `worker`.

    `nproc_per_host` None or 1: one process drives the worker's chips. Equal to the chips per
    worker: one process per chip, with torch_xla's multiprocess variables. Anything else raises
    ValueError (see `check_nproc_per_host`).
    """
    part, worker = locate(cluster, worker)
    return tpu_layout(part, nproc_per_host).process_env(worker, local_rank)


def torch_tpu_devices_per_worker(tpu: SliceTopology) -> int:
    """TorchTPU's devices on one worker (it runs a process per device): its chips, two per tpu7x chip."""
    return tpu.chips_per_worker * _TORCH_TPU_DEVICES_PER_CHIP.get(tpu.generation, 1)


def torch_tpu_topology(tpu: SliceTopology) -> str:
    """`TORCH_TPU_TOPOLOGY`: the slice's chips along each axis, host bounds times chips-per-host
    bounds ("2,4,1" for a v6e 2x4), with the devices per chip as a fourth axis on tpu7x."""
    axes = [h * c for h, c in zip(tpu.host_bounds, tpu.chips_per_host_bounds)]
    per_chip = _TORCH_TPU_DEVICES_PER_CHIP.get(tpu.generation)
    return ",".join(str(a) for a in axes + ([per_chip] if per_chip else []))


def _peer_address(host: Host) -> str:
    return host.internal_ip or host.hostname or host.address
