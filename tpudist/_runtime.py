"""Joining a job: `tpudist.init()` and the process/device queries.

`init()` reads the environment contract (`tpudist.contract`) that the launcher and `tpudist.spawn`
write, and joins JAX's multi-process runtime with process 0 as the coordinator. With nothing set it
is a single-process job. CPU-mesh runs get `--xla_force_host_platform_device_count` and gloo
collectives.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

import tpudist._coordinator as _coordinator
import tpudist._jaxcompat as _jaxcompat
import tpudist._jobsource as _jobsource
import tpudist._stacks as _stacks
import tpudist._versions as _versions
import tpudist.contract as contract

log = logging.getLogger("tpudist")

_lock = threading.Lock()
_job: contract.JobEnv | None = None
_joined_distributed = False

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def _set_xla_flag(flag: str, value: object) -> None:
    """Sets one flag in XLA_FLAGS; it only takes effect before JAX's backend starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag + "=")]
    flags.append(f"{flag}={value}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def cache_dir(environ: Any = os.environ) -> str | None:
    """The persistent compilation cache directory, or None when `TPUDIST_CACHE_DIR=off`."""
    raw = environ.get(contract.CACHE_DIR)
    if raw and raw.lower() in ("off", "0", "false", "none"):
        return None
    if raw:
        return raw
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpudist", "xla")


def _configure_jax(job: contract.JobEnv) -> None:
    import jax
    if job.platform:
        jax.config.update("jax_platforms", job.platform)
    if job.world_size > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    use_compilation_cache()


def use_compilation_cache(directory: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache in `directory` (default: `cache_dir()`);
    returns the directory, or None where `TPUDIST_CACHE_DIR=off`. `init()` calls it."""
    import jax
    directory = directory or cache_dir()
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        # Collectives are small programs: cache them too, not just the slow compiles.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if "://" not in directory:  # a local directory: every process keeps what it compiled
            _jaxcompat.cache_writes_from_every_process()
    return directory


def init(environ: Any = None, *, handle_sigterm: bool = True) -> contract.JobEnv:
    """Joins the job described by the environment contract; idempotent.

    Returns this process's `JobEnv`. Example::

        import tpudist
        job = tpudist.init()
        print(job.rank, tpudist.process_count(), len(tpudist.devices()))

    In a multi-process job, SIGTERM (how the launcher stops a process) then raises SystemExit(143)
    in the main thread, so `finally:` blocks and atexit handlers run before the process exits;
    a SIGTERM handler the program set before `init()` is kept instead. `handle_sigterm=False`
    leaves SIGTERM to JAX's preemption notifier, for programs that checkpoint at
    `jax.experimental.multihost_utils.reached_preemption_sync_point` (see tpudist/_exit.py).
    """
    global _job, _joined_distributed
    with _lock:
        if _job is not None:
            return _job
        # The launcher's contract, else a GKE / JobSet slice, else one process (tpudist/_jobsource.py).
        job = _jobsource.detect(os.environ if environ is None else environ)
        _versions.warn_untested()  # once: a torch or JAX the suite never ran on
        # First, so that even a hang while joining can be explained (tpudist/_stacks.py).
        _stacks.install(os.environ if environ is None else environ)
        if job.cpu_devices is not None:
            if _jaxcompat.backend_started():
                import jax
                have = len(jax.local_devices(backend="cpu"))
                if have != job.cpu_devices:
                    raise RuntimeError(
                        f"{contract.CPU_DEVICES}={job.cpu_devices} but JAX already started with {have} "
                        "CPU devices; call tpudist.init() before any JAX computation")
            else:
                _set_xla_flag(_DEVICE_COUNT_FLAG, job.cpu_devices)
        # XLA's CPU (gloo) collectives then fail after this long instead of waiting forever.
        _set_xla_flag(_COLLECTIVE_TIMEOUT_FLAG, math.ceil(job.collective_timeout))
        several = job.cpu_devices is not None and (job.world_size > 1 or job.cpu_devices > 1)
        if several and _SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", ""):
            # XLA:CPU's concurrency-optimized scheduler let two devices of one process enter a
            # program's collectives in different orders; that deadlocked a tensor-parallel step over
            # gloo between processes, and an expert-parallel one between one process's devices
            # (docs/sharding.md, known issues)
            _set_xla_flag(_SCHEDULER_FLAG, "false")
        _configure_jax(job)
        if job.world_size > 1:
            import jax
            log.debug("rank %d/%d joining coordinator %s", job.rank, job.world_size, job.coordinator)
            sigterm = _sigterm_handler()  # JAX's preemption notifier is about to take SIGTERM over
            # Rank 0 serves the coordinator on the job's own address, never every interface; a port
            # that is taken is said so here, not reported later as a timeout (tpudist/_coordinator.py).
            bind = (_coordinator.bind_address(job, os.environ if environ is None else environ)
                    if job.rank == 0 else None)
            try:
                with _coordinator.private_files(bind):
                    jax.distributed.initialize(
                        coordinator_address=job.coordinator,
                        num_processes=job.world_size,
                        process_id=job.rank,
                        initialization_timeout=int(max(1, job.init_timeout)),
                        coordinator_bind_address=bind,
                        # The contract says everything: JAX's own cluster detection (which the launcher's
                        # Open MPI variables would feed) must not also narrow each process's devices.
                        cluster_detection_method="deactivate",
                    )
            except Exception as e:  # noqa: BLE001 - re-raised with the job's facts
                raise RuntimeError(
                    f"rank {job.rank} on {job.host or 'this host'}: could not join the job at coordinator "
                    f"{job.coordinator} within {job.init_timeout:g}s ({e}). Check that every process was "
                    f"started and that rank 0's host is reachable; raise {contract.INIT_TIMEOUT} "
                    "for slow starts.") from e
            _joined_distributed = True
            _check_joined(job)
            import tpudist._exit as _exit
            _exit.install(job.rank, job.stop_grace, sigterm, handle_sigterm)
        _job = job
        return job


def _check_joined(job: contract.JobEnv) -> None:
    import jax
    if jax.process_count() != job.world_size or jax.process_index() != job.rank:
        raise RuntimeError(f"JAX reports process {jax.process_index()} of {jax.process_count()}, but "
                           f"the job says rank {job.rank} of {job.world_size}")


def _sigterm_handler() -> Any:
    """This process's Python SIGTERM handler (None off the main thread, where it cannot change)."""
    import signal
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def is_initialized() -> bool:
    """Whether `init()` has run in this process."""
    return _job is not None


def job() -> contract.JobEnv:
    """This process's job; joins it first if needed."""
    return _job if _job is not None else init()


def shutdown() -> None:
    """Leaves the job: shuts JAX's distributed runtime down. Safe to call more than once."""
    global _job, _joined_distributed
    with _lock:
        if _joined_distributed:
            import jax
            jax.distributed.shutdown()
            _joined_distributed = False
        _job = None


def process_index() -> int:
    """This process's rank in the job (0 on a single-process job)."""
    return job().rank


def process_count() -> int:
    """Number of processes in the job."""
    return job().world_size


def local_process_index() -> int:
    """This process's index among the processes of its host."""
    return job().local_rank


def local_process_count() -> int:
    """Number of processes on this host."""
    return job().local_world_size


def devices() -> list[Any]:
    """Every XLA device of every process, in JAX's global order."""
    job()
    import jax
    return jax.devices()


def local_devices() -> list[Any]:
    """This process's XLA devices."""
    job()
    import jax
    return jax.local_devices()


def device_slices(devices: Any) -> list[int]:
    """The slice of each of `devices`. Devices of a multi-slice TPU job report theirs
    (`slice_index`); elsewhere (CPU devices report slice 0 whatever the job) a device's slice is its
    process's, processes grouped slice-major by `MEGASCALE_NUM_SLICES` (unset: one slice). Works on
    anything with a `process_index`; does not join the job."""
    devices = list(devices)
    if reported_slices(devices) > 1:
        return [int(d.slice_index) for d in devices]
    env = _job if _job is not None else contract.JobEnv.from_environ(os.environ)
    if env.num_slices == 1:
        return [0] * len(devices)
    return [env.slice_of(int(d.process_index)) for d in devices]


def reported_slices(devices: Any) -> int:
    """How many distinct slices the devices themselves report (0 where some report none)."""
    tagged = {getattr(d, "slice_index", None) for d in devices}
    return 0 if None in tagged else len(tagged)


def slice_index(device: Any = None) -> int:
    """The slice `device` (default: this process) belongs to, 0 on a single-slice job.

    A job may span TPU slices joined over DCN; on a CPU mesh `MEGASCALE_NUM_SLICES=S` emulates
    S slices of consecutive ranks (see `tpudist.contract`). Example::

        tpudist.slice_index(), tpudist.num_slices()    # (1, 2) on rank 3 of 4 with MEGASCALE_NUM_SLICES=2
    """
    return device_slices([local_devices()[0] if device is None else device])[0]


def num_slices() -> int:
    """Number of slices the job's devices span (1 unless it spans several)."""
    return len(set(device_slices(devices())))


def kv_client() -> Any:
    """The coordination service client (key-value store, barriers); None in a single-process job."""
    job()
    if not _joined_distributed:
        return None
    return _jaxcompat.distributed_client()
