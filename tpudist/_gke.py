"""The `gke` job source: a TPU slice GKE or JobSet started, joined by `tpudist.init()` with no launcher.

GKE gives every pod of a multi-host TPU slice the slice's workers and the pod's place among them;
JobSet (one Indexed Job per slice, as xpk builds it) adds `JOB_COMPLETION_INDEX` and, over several
slices, libtpu's `MEGASCALE_*` variables. This source reads them as JAX's own GKE detection does
(jax/_src/clusters/cloud_tpu_cluster.py, `GkeTpuCluster`), one process per worker:

- the slice's workers: `TPU_PROCESS_ADDRESSES` if set, else `TPU_WORKER_HOSTNAMES` (worker order);
- this worker: `TPU_WORKER_ID`, else `JOB_COMPLETION_INDEX` (0 when the slice has one worker);
- slices: `MEGASCALE_NUM_SLICES` (unset: 1) and this pod's `MEGASCALE_SLICE_ID`;
- rank = slice id x workers per slice + worker; world size = workers per slice x slices;
- coordinator: slice 0's worker 0 (`MEGASCALE_COORDINATOR_ADDRESS` over several slices, else the
  first worker), any port in the address dropped, at `TPUDIST_COORDINATOR_PORT` (default 8482,
  JAX's on Cloud TPU). `MASTER_ADDR` defaults to the same host.

It applies only when none of the launcher's identity variables is set (the launcher sets the TPU
variables too, and its contract wins). Example (a stand-in for what GKE sets on worker 1)::

    job = GkeSource.job({"TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc", "TPU_WORKER_ID": "1"})
    (job.rank, job.world_size, job.coordinator)    # (1, 2, 'w-0.svc:8482')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tpudist import contract
from tpudist._jobsource import JobSource, Verdict

_WORKER_LISTS = (contract.TPU_PROCESS_ADDRESSES, contract.TPU_WORKER_HOSTNAMES)
_WORKER_INDEXES = (contract.TPU_WORKER_ID, contract.JOB_COMPLETION_INDEX)


class GkeSource(JobSource):
    """A TPU slice as GKE / JobSet describe it to each pod."""

    name = "gke"
    priority = 10

    @classmethod
    def applies(cls, environ: Mapping[str, str]) -> Verdict:
        name = _worker_list_name(environ)
        if name is None:
            return Verdict(False, f"neither {' nor '.join(_WORKER_LISTS)} is set")
        workers = environ[name].split(",")
        index = next((f"{n}={environ[n]}" for n in _WORKER_INDEXES if environ.get(n)), "no worker index")
        slices = environ.get(contract.NUM_SLICES)
        return Verdict(True, f"{name} lists {len(workers)} worker(s), {index}"
                             + (f", {contract.NUM_SLICES}={slices}" if slices else "")
                             + " (a TPU slice started by GKE / JobSet)")

    @classmethod
    def job(cls, environ: Mapping[str, str]) -> contract.JobEnv:
        name = _worker_list_name(environ)
        assert name is not None, "job() asked although applies() said no"
        workers = [w.strip() for w in environ[name].split(",")]
        if not all(workers):
            raise ValueError(f"{name}={environ[name]!r} has an empty entry; it must list every worker "
                             "of the slice, comma-separated")
        worker = _worker_index(environ, name, len(workers))
        num_slices = _positive(environ, contract.NUM_SLICES, 1)
        slice_id = 0
        coordinator_host = _host(workers[0])
        if num_slices > 1:
            slice_id = _required_int(environ, contract.SLICE_ID, f"{contract.NUM_SLICES}={num_slices}",
                                     "this pod's slice (JobSet: its Job's index)")
            if not 0 <= slice_id < num_slices:
                raise ValueError(f"{contract.SLICE_ID}={slice_id} is not in [0, {contract.NUM_SLICES}="
                                 f"{num_slices})")
            address = environ.get(contract.SLICE_COORDINATOR)
            if not address:
                raise ValueError(f"{contract.NUM_SLICES}={num_slices} but {contract.SLICE_COORDINATOR} is "
                                 "not set: only it names slice 0's worker 0, where the coordinator runs; "
                                 "set it to that pod's address")
            coordinator_host = _host(address)
        port = _positive(environ, contract.COORDINATOR_PORT, contract.DEFAULT_COORDINATOR_PORT)
        if port > 65535:
            raise ValueError(f"{contract.COORDINATOR_PORT}={port} is not a TCP port (1-65535)")
        per_slice = len(workers)
        rank = slice_id * per_slice + worker
        # The rest of the contract (timeouts, platform, ...) still comes from the environment.
        rest = contract.JobEnv.from_environ(
            {k: v for k, v in environ.items() if k not in (contract.NUM_SLICES, contract.SLICE_ID)})
        return dataclasses.replace(
            rest, rank=rank, world_size=per_slice * num_slices, local_rank=0, local_world_size=1,
            coordinator=f"{coordinator_host}:{port}", master_addr=rest.master_addr or coordinator_host.strip("[]"),
            worker=rank, num_workers=per_slice * num_slices, host=_host(workers[worker]).strip("[]"),
            num_slices=num_slices, slice_id=slice_id if num_slices > 1 else None)


def _worker_list_name(environ: Mapping[str, str]) -> str | None:
    return next((n for n in _WORKER_LISTS if environ.get(n)), None)


def _worker_index(environ: Mapping[str, str], list_name: str, count: int) -> int:
    for name in _WORKER_INDEXES:
        if environ.get(name):
            index = _required_int(environ, name, "", "")
            if not 0 <= index < count:
                raise ValueError(f"{name}={index} but {list_name} lists {count} worker(s) "
                                 f"({environ[list_name]}); it must be in [0, {count})")
            return index
    if count == 1:
        return 0
    raise ValueError(f"{list_name} lists {count} workers but neither {' nor '.join(_WORKER_INDEXES)} says "
                     "which one this pod is; GKE sets TPU_WORKER_ID on TPU pods and an Indexed Job sets "
                     "JOB_COMPLETION_INDEX: set one of them")


def _required_int(environ: Mapping[str, str], name: str, because: str, meaning: str) -> int:
    raw = environ.get(name)
    if not raw:
        raise ValueError(f"{because} but {name} is not set; set it to {meaning}")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _positive(environ: Mapping[str, str], name: str, default: int) -> int:
    value = default if not environ.get(name) else _required_int(environ, name, "", "")
    if value < 1:
        raise ValueError(f"environment variable {name}={value} must be at least 1")
    return value


def _host(address: str) -> str:
    """`address` without a port: "w-0.svc:8476" -> "w-0.svc"; IPv6 comes back bracketed."""
    address = address.strip()
    if address.startswith("["):
        return address[:address.index("]") + 1] if "]" in address else address
    if address.count(":") == 1:
        return address.split(":", 1)[0]
    return f"[{address}]" if ":" in address else address
