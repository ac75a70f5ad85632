"""Restoring a checkpoint step: every process reads its own shards, and none keeps what it read
unless every other one read too.

Reads with orbax's PyTree handler directly instead of through `CheckpointManager.restore`, whose
closing barrier would keep the processes that read their shards waiting until a timeout when
another process failed: here every process posts its outcome to the job's key-value store and
raises as soon as any process failed, naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import orbax.checkpoint as ocp

import tpudist._runtime as _runtime
from tpudist.checkpoint import _tree
from tpudist.checkpoint._store import (DEFAULT_TIMEOUT, CheckpointError, _interrupted, _item, _Job,
                                       _job_state, _path, _steps, _trim, _verified)


def restore(directory: str | os.PathLike, like: Any, *, step: int | None = None,
            timeout: float = DEFAULT_TIMEOUT) -> tuple[int, Any]:
    """Returns `(step, state)` read from `directory` (its latest committed step unless `step`
    is given), with the structure, kinds, dtypes and shardings of `like`; every process calls it.

    Each jax array is read into the sharding of its `like` leaf, so each process reads only the
    shards its devices hold; `like` may hold `jax.ShapeDtypeStruct`s with shardings instead of
    arrays (no memory). Torch tensors come back as torch tensors, numpy as numpy. Nothing is
    loaded unless everything matches and reads on every process:

    - no directory, no committed step, or no step `step`: FileNotFoundError naming the path;
    - another tree (missing or extra keys, another shape or dtype): ValueError naming the path,
      the key and both sides;
    - a step that is incomplete, truncated or corrupt, or another process that failed:
      CheckpointError naming the path and what is missing.

    Example::

        step, state = tpudist.checkpoint.restore("/ckpt/run1", like=state)
    """
    path = _path(directory)
    job = _job_state()
    with job.lock:
        job.restores += 1
        call = job.restores
    shared = _runtime.kv_client() is not None
    rank, world = (job.job.rank, job.job.world_size) if shared else (0, 1)
    # Each process checks its share of the files, and every process hears every verdict before any
    # reads: a process must not read (and fail on) a file another process found corrupt.
    chosen: int | None = None
    error: BaseException | None = None
    try:
        chosen = _check_here(path, step, rank, world)
    except Exception as e:  # noqa: BLE001 - shared with the other processes, then raised
        error = e
    _agree(job, f"restore/{call}/verify", f"verifying {path}", error, timeout)
    assert chosen is not None
    result: tuple[int, Any] | None = None
    try:
        result = chosen, _read_here(path, like, chosen)
    except Exception as e:  # noqa: BLE001 - shared with the other processes, then raised
        error = e
    _agree(job, f"restore/{call}", f"restoring {path}", error, timeout)
    assert result is not None
    return result


def _check_here(path: str, step: int | None, rank: int, world: int) -> int:
    """The step to read (the latest committed one unless `step`), once this process's share of its
    files verifies."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path}")
    found = _steps(path)
    if step is None:
        if not found:
            raise FileNotFoundError(f"{path} holds no committed checkpoint{_interrupted(path)}")
        step = found[-1]
    elif step not in found:
        raise FileNotFoundError(f"{path} has no committed step {step}; its steps are {found}"
                                f"{_interrupted(path)}")
    problem = _verified(path, step, rank, world)
    if problem is not None:
        raise CheckpointError(f"{path} step {step} is incomplete or corrupt: {problem}. Nothing was loaded; "
                              f"restore an earlier step (step=N; latest_step({path!r}, verify=True) "
                              f"names the newest that verifies) or delete step {step}")
    return step


def _read_here(path: str, like: Any, step: int) -> Any:
    where = f"{path} step {step}"
    item = _item(path, step)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        try:
            metadata = handler.metadata(item)
        except Exception as e:  # noqa: BLE001 - re-raised with the path
            raise CheckpointError(f"{where} is corrupt: cannot read its tree metadata "
                                  f"{item / '_METADATA'}: {_reason(e)}") from e
        _tree.check(metadata.tree, like, where)
        _tree.block_until_ready(like)
        target, restore_args = _tree.restore_plan(like)
        try:
            restored = handler.restore(item, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
        except Exception as e:  # noqa: BLE001 - re-raised with the path
            raise CheckpointError(f"{where} is incomplete or corrupt: {_reason(e)}") from e
    finally:
        handler.close()
    return _tree.like_kinds(like, restored)


def _reason(e: BaseException) -> str:
    """The innermost message of an exception chain (TensorStore's status, e.g. `NOT_FOUND: Error
    reading "w/0.0" in OCDBT database ...`), without TensorStore's spec dump."""
    chain: list[BaseException] = []
    while e is not None and len(chain) < 8:
        if isinstance(e, json.JSONDecodeError):  # json's own cause is a bare StopIteration(347)
            return f"it is truncated or not valid JSON ({e})"
        if not isinstance(e, StopIteration):
            chain.append(e)
        e = e.__cause__ or e.__context__
    if not chain:
        return "unknown error"
    deepest = next((x for x in reversed(chain) if str(x).strip()), chain[0])
    return _trim(str(deepest))


def _agree(job: _Job, key: str, what: str, error: BaseException | None, timeout: float) -> None:
    """Every process learns whether every other one succeeded: raises this process's own error,
    else CheckpointError naming the first other process that failed."""
    client = _runtime.kv_client()
    if client is None:
        if error is not None:
            raise error
        return
    prefix = f"tpudist/checkpoint/{key}/"
    rank, world = job.job.rank, job.job.world_size
    client.key_value_set(prefix + str(rank), "" if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for other in range(world):
        if other == rank:
            continue
        try:
            outcome = client.blocking_key_value_get(prefix + str(other), int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - a deadline, reported as such
            raise CheckpointError(f"process {other} did not finish {what} within {timeout:g}s") from e
        if outcome:
            raise CheckpointError(f"process {other} failed {what}, so process {rank} loaded nothing "
                                  f"either: {outcome}")
