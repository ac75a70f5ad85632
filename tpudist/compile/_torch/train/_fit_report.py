"""What `fit` counts and reports per epoch: examples and tokens, the step's FLOPs and MFU, and
goodput (tpudist/compile/_efficiency.py: where the wall time went)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from tpudist.compile._efficiency import Goodput


def compile_seconds(step: Any) -> float:
    """What the fused step spent capturing and compiling so far (0 for other steps)."""
    stats = getattr(step, "stats", None)
    return stats.capture_seconds + stats.compile_seconds if hasattr(stats, "compile_seconds") else 0.0


def examples_in(batch: Any) -> int:
    """Number of examples in a batch: the leading dimension of its first tensor."""
    rows = getattr(batch, "rows", None)  # a DeviceBatch
    if isinstance(rows, int):
        return rows
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        for item in batch:
            n = examples_in(item)
            if n:
                return n
    return 0


def tokens_in(batch: Any) -> int | None:
    """Tokens in a batch: the elements of its `input_ids` (a dict batch, as Hugging Face models
    take), else of its first item where that is a 2-D integer tensor (token ids of a `(ids, target)`
    batch); None where the batch holds no token ids."""
    if hasattr(batch, "spec") and hasattr(batch, "keys"):  # a DeviceBatch: each leaf's (shape, dtype)
        batch = tree_unflatten([torch.empty(key[0], dtype=key[1], device="meta")
                                if len(key) == 3 and isinstance(key[1], torch.dtype) else None
                                for key in batch.keys], batch.spec)
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0]
    else:
        return None
    if isinstance(ids, torch.Tensor) and ids.ndim == 2 and not ids.is_floating_point() and not ids.is_complex():
        return ids.numel()
    return None


def epoch_record(epoch: int, totals: list[float], clock: Goodput, steps: int, flops: float | None,
                 peak: float | None) -> dict[str, Any]:
    """One epoch's record; `totals` are the sums over processes of (loss, examples, steps, tokens,
    processes whose batches held no token ids), `steps` this process's, `flops` one device's per step."""
    loss_total, examples_total, steps_total, tokens_total, untokenized = totals
    if untokenized:
        tokens_total = -1.0
    seconds = clock.wall_s
    busy = clock.productive_s
    record: dict[str, Any] = {
        "epoch": epoch, "loss": loss_total / max(steps_total, 1), "examples": int(examples_total),
        "seconds": seconds, "examples_per_s": examples_total / seconds if seconds > 0 else 0.0,
        "compile_seconds": clock.compile_s, "data_seconds": clock.data_s, "checkpoint_seconds": clock.checkpoint_s,
        "goodput": clock.goodput,
        "tokens": int(tokens_total) if tokens_total >= 0 else None,
        # the rate of stepping: compile, checkpoints and the wait for data left out
        "tokens_per_s": tokens_total / busy if tokens_total >= 0 and busy > 0 else None,
        "flops_per_step": flops,
        "mfu": flops * steps / (busy * peak) if flops is not None and peak and busy > 0 and steps else None,
    }
    return record
