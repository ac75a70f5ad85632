"""Saving and finding checkpoints, on orbax-checkpoint, and the job state that restoring shares.

Layout: orbax's own, `DIRECTORY/<step>/default/` per step (a `CheckpointManager` of one item,
saved with `PyTreeSave`): every process writes its own shards into its own `ocdbt.process_<i>`
store, and process 0 writes the tree's metadata and the host values (numpy, scalars, strings).

Atomicity is orbax's commit protocol: a save writes into `<step>.orbax-checkpoint-tmp-<time>/`,
every process finishes its writes, and process 0 renames the directory to `<step>` (the commit).
A directory that was never renamed is not a step: `latest_step` and `restore` skip it, and the
next save's manager deletes it. Saves are asynchronous underneath (orbax copies the arrays to host
memory, then writes and commits in a background thread); `save(wait=True)` waits for the commit.

Every step also holds `_CHECKSUMS`, the size and CRC32 of each of its files, written before the
commit (see _verify); `restore` checks them before it reads, each process its share of the files,
and `latest_step(verify=True)` skips steps that fail. A save that fails removes its temporary
directory, so a full disk does not stay full of a step that will never commit.

Restoring is in `_restore`.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import shutil
import threading
import time
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

import tpudist._runtime as _runtime
import tpudist.contract as contract
from tpudist.checkpoint import _tree, _verify

log = logging.getLogger("tpudist.checkpoint")

DEFAULT_TIMEOUT = 1200.0  # seconds; orbax's own default for an asynchronous save's barriers
_ITEM = "default"  # the item directory of a one-item CheckpointManager
_NAMES = ocp.path.step.standard_name_format()  # <step>, as CheckpointManager names steps
_TMP = ocp.path.atomicity.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"


class _OwnWaitsFilter(logging.Filter):
    """Drops orbax's "Waiting for previous save to complete took N seconds" warning: orbax counts
    every wait since the last save, the caller's own `handle.wait()` included, as time the next
    save waited. tpudist logs the wait a save does make (INFO, logger "tpudist.checkpoint")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Waiting for previous save to complete" not in record.getMessage()


logging.getLogger("absl").addFilter(_OwnWaitsFilter())


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read: a step directory that is incomplete, truncated
    or corrupt, a save that failed, or another process that failed to restore."""


@dataclasses.dataclass
class _Directory:
    """One checkpoint directory this process saves to in the current job."""

    path: str
    manager: Any  # ocp.CheckpointManager
    keep: int | None
    timeout: float
    in_flight: int | None = None  # the step of the save that may still be running


class _Job:
    """What tpudist.checkpoint keeps for one job: a new job (shutdown, init) starts afresh."""

    def __init__(self, job: contract.JobEnv):
        self.job = job
        self.directories: dict[str, _Directory] = {}
        self.restores = 0  # restore() calls so far; names their key-value keys
        self.saves: dict[str, int] = {}  # save() calls per directory so far; name a failure's key
        self.barrier_uses: dict[str, int] = {}  # orbax reuses barrier keys: each use is a barrier of its own
        self.lock = threading.Lock()
        # not `lock`: save() holds that while orbax runs its first barriers on the same thread
        self.barrier_lock = threading.Lock()


_current: _Job | None = None
_exit_hook = False


def _job_state() -> _Job:
    global _current, _exit_hook
    job = _runtime.job()
    if _current is None or _current.job is not job:
        _current = _Job(job)
    if not _exit_hook:
        atexit.register(_wait_at_exit)  # after jax's own atexit hooks, so it runs before them
        _exit_hook = True
    return _current


def _path(directory: Any) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    return os.path.abspath(os.fspath(directory))


def _steps(path: str) -> list[int]:
    """The committed steps in `path`, ascending (none when it does not exist)."""
    if not os.path.isdir(path):
        return []
    return sorted(m.step for m in _NAMES.find_all(epath.Path(path)))


def _interrupted(path: str) -> str:
    left = sorted(n for n in os.listdir(path) if _TMP in n) if os.path.isdir(path) else []
    return f" (interrupted saves left {left}, never committed)" if left else ""


def latest_step(directory: str | os.PathLike, *, verify: bool = False) -> int | None:
    """The newest committed step in `directory`, or None when it holds none or does not exist.

    A save interrupted before its commit does not count. With `verify=True` a step counts only
    when every file of it matches the checksums written at its save (this reads the whole step;
    a step that fails is logged with the file and skipped, so the answer is the newest step a
    `restore` will accept); by default only the step's name is looked at. Needs no other process.
    Example::

        start = tpudist.checkpoint.latest_step(ckpt_dir, verify=True)
        if start is not None:
            start, state = tpudist.checkpoint.restore(ckpt_dir, like=state, step=start)
    """
    path = _path(directory)
    for step in reversed(_steps(path)):
        if not verify:
            return step
        problem = _verified(path, step)
        if problem is None:
            return step
        log.warning("latest_step(%s, verify=True): skipping step %d: %s", path, step, problem)
    return None


def _item(path: str, step: int) -> epath.Path:
    return epath.Path(path) / _NAMES.build_name(step) / _ITEM


def _verified(path: str, step: int, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with step `step` (this process's share of its files), or None."""
    item = _item(path, step)
    if not item.is_dir():
        return f"it has no {_ITEM!r} directory ({item}); it is not a checkpoint that tpudist.checkpoint.save wrote"
    if not (item / "_METADATA").exists():
        return f"its tree metadata {item / '_METADATA'} is missing"
    try:
        return _verify.verify(os.fspath(item), rank, world, on_unverified=lambda: log.warning(
            "%s step %d has no checksums (written by orbax directly or an older tpudist): read "
            "unverified", path, step))
    except ValueError as e:
        return str(e)


# -- saving ---------------------------------------------------------------------------------------

class SaveHandle:
    """A save that may still be writing: `wait()` returns once its step is committed (and raises
    CheckpointError if it failed); `done()` says whether it has finished."""

    def __init__(self, directory: _Directory, step: int):
        self._directory = directory
        self.path = directory.path
        self.step = step

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, step={self.step}, done={self.done()})"

    def done(self) -> bool:
        d = self._directory
        return d.in_flight != self.step or not d.manager.is_saving_in_progress()

    def wait(self) -> None:
        _finish(self._directory)


def _finish(d: _Directory) -> None:
    step, d.in_flight = d.in_flight, None
    try:
        d.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - re-raised with the path and step
        raise _save_failed(d.path, step, e) from e


def _save_failed(path: str, step: int | None, e: BaseException) -> CheckpointError:
    """The error for a failed save, once its temporary directory is gone: left behind, it would
    keep a full disk full and fail every later save too. The step was not committed (the rename
    that commits it needs every process to succeed), so nothing of it is worth keeping."""
    removed = []
    if step is not None and os.path.isdir(path):
        prefix = _NAMES.build_name(step) + _TMP
        for name in os.listdir(path):
            if name == prefix or name.startswith(prefix + "-"):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
                removed.append(name)
    note = f"; removed its temporary directory {removed[0]}" if removed else ""
    return CheckpointError(f"saving step {step} to {path} failed: {_trim(str(e))}{note}. Steps saved "
                           "before it are intact; free space (or fix the cause) and save again")


def _trim(text: str) -> str:
    """`text` without TensorStore's spec dump, on one line."""
    text = text.split(" [tensorstore_spec")[0].split(" See full TensorStore details")[0]
    return " ".join(text.split())


# A save whose writes fail on one process fails on every process within a poll: the failing process
# publishes its cause in the coordination service's key-value store (under the directory and the
# number of the save, the same on every process), and the barriers orbax waits at (tpudist's own,
# below, in place of the service's) watch for it. Before, the others waited at orbax's barrier for
# its whole timeout (1,200 s by default).
_KV = "tpudist/checkpoint"
_POLL_S = 0.05  # the longest pause between polls of a barrier


def _tell_peers(state: _Job, key: str, error: BaseException) -> None:
    """Called in orbax's background thread when this process's writes failed."""
    kv = _runtime.kv_client()
    if kv is None:
        return
    job = state.job
    try:
        kv.key_value_set(key, f"rank {job.rank} on {job.host or 'its host'} could not write its part: "
                              f"{_trim(str(error))}")
    except Exception:  # noqa: BLE001 - best effort: the peers then wait for the barrier's timeout
        pass


def _barrier_fn(state: _Job, failed_key):
    """orbax's barrier (a `BarrierSyncFn`): every process's arrival recorded in the key-value store,
    polled until all have come, one has published a failure of the save in flight (`failed_key()`),
    or the timeout passed."""
    kv = _runtime.kv_client()
    if kv is None:
        return None  # one process: orbax's own (no barrier)
    job = state.job

    def sync(*, key: str, timeout_ms: int) -> None:
        with state.barrier_lock:
            use = state.barrier_uses[key] = state.barrier_uses.get(key, 0) + 1
        arrived = f"{_KV}/barrier/{key}/{use}/"
        kv.key_value_set(f"{arrived}{job.rank}", "1")
        failure = failed_key()
        start, pause = time.monotonic(), 0.002
        while True:
            try:
                failed = kv.key_value_try_get(failure)
            except Exception:  # noqa: BLE001 - NOT_FOUND: no process failed
                failed = None
            if failed is not None:
                raise RuntimeError(failed)
            here = {k.rsplit("/", 1)[-1] for k, _ in kv.key_value_dir_get(arrived)}
            if len(here) >= job.world_size:
                return
            waited = time.monotonic() - start
            if waited * 1000 >= timeout_ms:
                missing = sorted(set(range(job.world_size)) - {int(r) for r in here})
                raise TimeoutError(f"ranks {missing} did not finish writing within {waited:.0f}s (the save's "
                                   f"timeout): stuck, or gone")
            time.sleep(pause)
            pause = min(_POLL_S, pause * 2)  # peers arriving within milliseconds are not kept waiting
    return sync


def _manager(state: _Job, path: str, keep: int | None, timeout: float) -> _Directory:
    d = state.directories.get(path)
    if d is not None and (d.keep, d.timeout) == (keep, timeout):
        return d
    if d is not None:
        _finish(d)
        d.manager.close()
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]

    def failed_key() -> str:
        return f"{_KV}/failed/{digest}/{state.saves.get(path, 0)}"

    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=True,
        cleanup_tmp_directories=True,  # what interrupted saves left behind
        async_options=ocp.AsyncOptions(timeout_secs=max(1, int(timeout)), barrier_sync_fn=_barrier_fn(state, failed_key)),
        # Distinct barrier names per directory: saves to two directories may overlap.
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix="tpudist-" + digest),
    )
    # orbax's PyTree handler plus the checksums (_verify), for every PyTreeSave to this directory;
    # a failed write told to the peers under the number of the save in flight.
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handlers.add(None, ocp.args.PyTreeSave, _verify.ChecksummingHandler(
        multiprocessing_options=options.multiprocessing_options,
        on_failure=lambda error: _tell_peers(state, failed_key(), error)))
    d = _Directory(path, ocp.CheckpointManager(path, options=options, handler_registry=handlers),
                   keep, timeout)
    state.directories[path] = d
    return d


def save(directory: str | os.PathLike, step: int, state: Any, *, wait: bool = True,
         keep: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> SaveHandle:
    """Saves `state` as step `step` of `directory`; every process calls it with its state.

    See `tpudist.checkpoint` for what a state may hold. Each process writes only its own shards
    (process 0 also the metadata and the host values). The step appears atomically: until every
    process has written and the step is committed, `latest_step` and `restore` see the previous
    one. With `wait=False` the call returns once the arrays are copied to host memory; the write
    and commit go on in the background (call `.wait()` on the returned handle, or
    `tpudist.checkpoint.wait()`; the next save to the directory, and the program's exit, wait for
    it). `keep=N` keeps the newest N steps. `timeout` bounds each wait for the other processes.

    Raises ValueError when `step` is not after the directory's latest step, TypeError for a
    leaf that cannot be checkpointed, CheckpointError when the write fails. Example::

        tpudist.checkpoint.save("/ckpt/run1", 100, {"params": params, "opt": opt_state})
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None (keep every step) or a positive int, got {keep!r}")
    path = _path(directory)
    tree = _tree.storable(state, copy=not wait)
    _tree.block_until_ready(tree)
    job = _job_state()
    with job.lock:
        d = _manager(job, path, keep, float(timeout))
        previous, start = d.in_flight, time.perf_counter()
        _finish(d)  # the previous save of this directory commits first
        if previous is not None:
            log.info("step %d: waited %.2fs for step %d to commit", step, time.perf_counter() - start, previous)
        committed = _steps(path)
        if committed and step <= committed[-1]:
            raise ValueError(f"{path} already has step {committed[-1]}; save a later step (steps "
                             "only grow: to go on from an older step, delete the newer ones first)")
        job.saves[path] = job.saves.get(path, 0) + 1
        try:
            started = d.manager.save(step, args=ocp.args.PyTreeSave(tree), force=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the path and step
            raise _save_failed(path, step, e) from e
        if not started:
            raise CheckpointError(f"orbax declined to save step {step} to {path}")
        d.in_flight = step
    handle = SaveHandle(d, step)
    if wait:
        handle.wait()
    return handle


def wait(directory: str | os.PathLike | None = None) -> None:
    """Waits until the saves still running (to `directory`, or to every directory) are committed;
    raises CheckpointError for one that failed."""
    if _current is None:
        return
    with _current.lock:
        found = list(_current.directories.values())
    path = None if directory is None else _path(directory)
    for d in found:
        if path is None or d.path == path:
            _finish(d)


def _wait_at_exit() -> None:
    if _current is None:
        return
    for d in list(_current.directories.values()):
        try:
            _finish(d)
            d.manager.close()
        except Exception as e:  # noqa: BLE001 - at exit: report, never mask the program's own exit
            log.error("tpudist.checkpoint: %s", e)
