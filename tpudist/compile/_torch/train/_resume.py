"""`fit`'s checkpoints: what training state to save so that a restarted job continues exactly.

A checkpoint of `fit` holds, at an optimizer step:

- the fused step's device state, as it is on the devices (`Mirror.state_tree`: parameters,
  optimizer state, step counts; sharded arrays stay sharded, each process writes its own rows) and
  the model's buffers;
- per process (one row per device, each process writing its own): torch's RNG state now and at the
  start of the epoch, the loader's shuffling generator's state at the start of the epoch, and the
  step's dropout key;
- the same on every process: the epoch, how many of its batches this process has trained on, the
  global step, the optimizer's param-group hyperparameters and the LR scheduler's state.

Resuming puts all of it back and replays the epoch's shuffle: the generators are reset to their
epoch-start states, the loader is iterated again and the batches already trained on are skipped.
The rest of the run then computes what an uninterrupted run computes, bit for bit (on the same
topology).
"""

from __future__ import annotations

import base64
import logging
import pickle
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import jax

    from tpudist.compile._torch.train._fused import TrainStep

log = logging.getLogger("tpudist.fit")
_RNG_BYTES = len(torch.get_rng_state())


@dataclass
class Progress:
    """Where training stands: `epoch` (1-based) being trained, `position` batches of it done on
    this process, `global_step` optimizer steps done in all."""

    epoch: int = 1
    position: int = 0
    global_step: int = 0


@dataclass(frozen=True)
class Layout:
    """How a run splits the loader: `processes` processes, each taking `accumulate` of its batches
    per optimizer step, so every step trains on `processes * accumulate` loader batches."""

    processes: int
    accumulate: int

    @property
    def batches_per_step(self) -> int:
        return self.processes * self.accumulate


@dataclass(frozen=True)
class Saved:
    """What the latest checkpoint of a directory says of the run that wrote it, read once by every
    process on its own before the step is built (a restart over fewer hosts, --min-hosts, chooses
    its accumulation from it, and reads the per-process rows of another process count whole)."""

    layout: Layout | None  # None: saved before layouts were recorded
    rows: int | None  # its per-process state's rows (one per device of the run that wrote it)


def read_saved(directory: str) -> Saved | None:
    """The latest checkpoint's `Saved`, or None when the directory holds none."""
    import orbax.checkpoint as ocp

    from tpudist import checkpoint
    from tpudist.checkpoint._store import _item, _path
    step = checkpoint.latest_step(directory)
    if step is None:
        return None
    item = _item(_path(directory), step)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        flat = ocp.tree.to_flat_dict(handler.metadata(item).tree)
        layout = None
        if ("progress", "processes") in flat:
            want = {"progress": {"processes": 0, "accumulate": 0}}
            got = handler.restore(item, args=ocp.args.PyTreeRestore(
                want, restore_args={"progress": {k: ocp.RestoreArgs() for k in want["progress"]}},
                partial_restore=True))["progress"]
            layout = Layout(int(got["processes"]), int(got["accumulate"]))
    finally:
        handler.close()
    rows = flat.get(("process", "torch_rng"))
    return Saved(layout, int(rows.shape[0]) if rows is not None else None)


def elastic_accumulation(saved: Layout, processes: int, accumulate: int) -> tuple[int, str]:
    """The accumulation steps that keep a checkpoint's global batch on `processes` processes, and
    what to tell the user ("" when nothing changes). The same global batch when the saved batches
    per step split evenly over the processes; else the nearest smaller one, said."""
    if saved.processes == processes:  # the same job, or the user changed accumulate_steps: theirs to choose
        return accumulate, ""
    per_step = saved.batches_per_step
    if per_step % processes == 0:
        k = per_step // processes
        return k, (f"fit: the checkpoint was trained by {saved.processes} processes x {saved.accumulate} "
                   f"accumulation steps; {processes} processes now take {k} each, so every step still "
                   f"trains on {per_step} loader batches (the same global batch)")
    k = max(1, per_step // processes)
    return k, (f"fit: warning: the checkpoint's {per_step} loader batches per step ({saved.processes} processes "
               f"x {saved.accumulate}) do not split over {processes} processes; each takes {k}, so a step now "
               f"trains on {k * processes} batches (the global batch changes; the learning rate does not)")


def resumed_accumulation(checkpoint_dir: str, saved: Saved | None, count: int, accumulate_steps: int,
                         shard: bool, rank: int) -> int:
    """fit's accumulation steps for a run that resumes `saved`, a checkpoint of `checkpoint_dir` saved by
    another number of processes: as many as keep its global batch (`elastic_accumulation`), said on rank 0."""
    import sys
    layout = saved.layout if saved is not None else None
    if layout is None or layout.processes == count:
        return accumulate_steps
    if not shard:
        if rank == 0:
            print(f"fit: warning: the checkpoint in {checkpoint_dir} was trained by {layout.processes} processes, "
                  f"this run has {count}; with shard=False your loader decides each process's share, so the "
                  "global batch is what it gives (fit(shard=True) keeps the checkpoint's)", file=sys.stderr, flush=True)
        return accumulate_steps
    accumulate_steps, said = elastic_accumulation(layout, count, accumulate_steps)
    if said and rank == 0:
        print(said, file=sys.stderr, flush=True)
    return accumulate_steps


def loader_generator(loader: Any) -> torch.Generator | None:
    """The generator a DataLoader shuffles with, if it has one of its own."""
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            return generator
    return None


def _encode(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text.encode("ascii")))


class Checkpointer:
    """Saves and restores one `fit`'s training state under `directory` (see the module docstring)."""

    def __init__(self, directory: str, step: "TrainStep", optimizer: torch.optim.Optimizer, scheduler: Any,
                 loader: Any, layout: Layout, saved: Saved | None):
        self.directory, self.step, self.optimizer, self.scheduler = str(directory), step, optimizer, scheduler
        self.layout, self.latest = layout, saved  # this run's layout; the latest checkpoint's, read at the start
        self.generator = loader_generator(loader)
        self.epoch_rng = torch.get_rng_state()
        self.epoch_loader_rng = self.generator.get_state() if self.generator is not None else None

    def epoch_started(self) -> None:
        """Records the generators' states at the start of an epoch (before its loader is iterated)."""
        self.epoch_rng = torch.get_rng_state()
        self.epoch_loader_rng = self.generator.get_state() if self.generator is not None else None

    # -- the tree ---------------------------------------------------------------------------------

    def _per_process(self, row: np.ndarray) -> jax.Array:
        """`row` (this process's value) as a global array with one row per device: every process
        writes its own rows, and reads them back."""
        placement = self.step.placement
        return placement.put(np.tile(row[None], (placement.local_count, 1)), split=True)

    def tree(self, progress: Progress) -> dict[str, Any]:
        from tpudist.compile._torch.train._state import host_value
        step = self.step
        rng = step.rng_key()
        key = np.zeros(2, np.uint32) if rng is None else np.asarray(
            host_value(step.placement, rng, False)).astype(np.uint32).reshape(2)
        loader_rng = (self.epoch_loader_rng.numpy() if self.epoch_loader_rng is not None
                      else np.zeros(_RNG_BYTES, np.uint8))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {
            "state": step.state(),
            "process": {"torch_rng": self._per_process(torch.get_rng_state().numpy()),
                        "epoch_rng": self._per_process(self.epoch_rng.numpy()),
                        "loader_rng": self._per_process(_fit(loader_rng, _RNG_BYTES)),
                        "step_key": self._per_process(key), "has_key": self._per_process(
                            np.asarray([rng is not None], np.uint8))},
            "progress": {"epoch": progress.epoch, "position": progress.position,
                         "global_step": progress.global_step, "processes": self.layout.processes,
                         "accumulate": self.layout.accumulate},
            "hyper": {"optimizer": _encode(groups),
                      "scheduler": _encode(self.scheduler.state_dict() if self.scheduler is not None else None)},
        }

    # -- saving and restoring ---------------------------------------------------------------------

    def save(self, progress: Progress, wait: bool) -> None:
        """Saves the state after `progress.global_step` steps (once per step; `wait`: until committed)."""
        from tpudist import checkpoint
        if progress.global_step == getattr(self, "_saved", None):
            if wait:
                checkpoint.wait(self.directory)
            return
        checkpoint.save(self.directory, progress.global_step, self.tree(progress), wait=wait)
        self._saved = progress.global_step

    def restore(self) -> Progress | None:
        """Puts the latest checkpoint back, if the directory holds one; returns where it stood."""
        from tpudist import checkpoint
        if self.latest is None:
            return None
        like = self.tree(Progress())  # device arrays of the right shapes and shardings
        rows = self.latest.rows if self.latest.rows != like["process"]["torch_rng"].shape[0] else None
        if rows is not None:  # saved by other processes (a restart over fewer hosts): read whole
            like["process"] = {k: np.zeros((rows, v.shape[1]), v.dtype) for k, v in like["process"].items()}
        layout = self.latest.layout
        if layout is None:  # a checkpoint from before layouts were recorded
            del like["progress"]["processes"], like["progress"]["accumulate"]
        saved_at, tree = checkpoint.restore(self.directory, like=like)
        self._saved = saved_at
        self.step.load_state(tree["state"])
        if rows is None:
            process = {k: _local_row(v) for k, v in tree["process"].items()}
        else:  # this rank's old rows when it had some, else rank 0's: the random streams go on from there
            from tpudist._runtime import process_index
            per = rows // layout.processes if layout is not None and rows % layout.processes == 0 else rows
            row = process_index() * per if process_index() * per < rows else 0
            process = {k: np.asarray(v)[row] for k, v in tree["process"].items()}
        torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(process["torch_rng"]).astype(np.uint8)))
        self.epoch_rng = torch.from_numpy(np.ascontiguousarray(process["epoch_rng"]).astype(np.uint8))
        if self.generator is not None:
            self.epoch_loader_rng = torch.from_numpy(np.ascontiguousarray(process["loader_rng"]).astype(np.uint8))
        if int(process["has_key"][0]):
            key = np.ascontiguousarray(process["step_key"]).astype(np.uint32)
            self.step.restore_rng_key(key)
        for group, saved in zip(self.optimizer.param_groups, _decode(tree["hyper"]["optimizer"])):
            group.update(saved)
        scheduler_state = _decode(tree["hyper"]["scheduler"])
        if self.scheduler is not None and scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        progress = tree["progress"]
        log.info("fit: resumed from %s at step %d", self.directory, saved_at)
        return Progress(int(progress["epoch"]), int(progress["position"]), int(progress["global_step"]))

    def replay_epoch_start(self) -> None:
        """Resets the generators to the resumed epoch's start, so its shuffle is drawn again; the
        current torch RNG state (restored) is put back once the loader has drawn it."""
        now = torch.get_rng_state()
        torch.set_rng_state(self.epoch_rng)
        if self.generator is not None and self.epoch_loader_rng is not None:
            self.generator.set_state(self.epoch_loader_rng)
        self._after_draw = now

    def resume_rng(self) -> None:
        after = getattr(self, "_after_draw", None)
        if after is not None:
            torch.set_rng_state(after)
            self._after_draw = None


def _fit(row: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    out[:min(size, row.size)] = row.reshape(-1)[:size]
    return out


def _local_row(array: jax.Array) -> np.ndarray:
    """This process's row of a per-process array."""
    first = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)[0]
    return np.asarray(first.data)[0]


class Stopped(Exception):
    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class stop_on_sigterm:
    """While `fit` checkpoints: SIGTERM raises this process's flag in the fused step (see
    `TrainStep.raise_signal`) instead of ending the process; `agreed(signal)` is true on every
    process at the same step once any process's flag went through a step's all-reduce. Each call
    reads the flag of the step before the one just launched (done by then, or nearly), so the
    host waits for at most one step: one 4-byte read per step while checkpointing."""

    def __init__(self, step: "TrainStep | None"):
        self.step = step
        self.previous: Any = None  # the SIGTERM handler before ours, as signal.signal returned it
        self._pending: jax.Array | None = None

    def __enter__(self) -> "stop_on_sigterm":
        if self.step is not None:
            self.step.signals = True  # the steps take the flag (another signature: compiled once)
        if self.step is not None and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, lambda *_: self.step.raise_signal())
        return self

    def agreed(self, signal_of_last_step: jax.Array | None) -> bool:
        pending, self._pending = self._pending, signal_of_last_step
        if self.step is None or pending is None:
            return False
        from tpudist.compile._torch.train._state import to_host
        return float(np.asarray(to_host(pending.addressable_shards[0].data)).reshape(())) > 0

    def __exit__(self, *exc: Any) -> None:
        if self.step is not None:
            self.step.signals = False
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
