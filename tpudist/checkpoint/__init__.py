"""Checkpoints of sharded state, on orbax-checkpoint: every process writes only its own shards.

    import tpudist
    state = {"params": params, "opt": opt_state, "step": 100}
    tpudist.checkpoint.save("/ckpt/run1", 100, state)                # every process calls it
    handle = tpudist.checkpoint.save("/ckpt/run1", 200, state, wait=False)   # writes in the background
    step, state = tpudist.checkpoint.restore("/ckpt/run1", like=state)       # latest step, like's shardings
    tpudist.checkpoint.latest_step("/ckpt/run1")                     # 200, or None
    tpudist.checkpoint.latest_step("/ckpt/run1", verify=True)        # the newest whose checksums hold

A state is a pytree whose leaves are jax arrays (sharded or not: `ShardedEmbedding` tables are
written and read shard by shard, never gathered), numpy arrays and scalars, Python numbers, bools
and strings, or torch tensors (a `model.state_dict()` and an `optimizer.state_dict()` are states as
they are). Host values (numpy, Python, torch, and jax arrays local to one process of a
multi-process job) must be the same on every process: process 0 writes them. The directory must be
one that every process sees (a shared file system, or GCS). See docs/checkpoint.md.
"""

from __future__ import annotations

from tpudist.checkpoint._restore import restore
from tpudist.checkpoint._store import DEFAULT_TIMEOUT, CheckpointError, SaveHandle, latest_step, save, wait

__all__ = ["CheckpointError", "DEFAULT_TIMEOUT", "SaveHandle", "latest_step", "restore", "save", "wait"]
