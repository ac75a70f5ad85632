"""Data-parallel PyTorch training across processes: `optimizer_step`, `eager_step` and `fit`.

    for x, y in loader:                       # each process: its own part of the global batch
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        tpudist.optimizer_step(opt)           # mean of every grad over processes, then opt.step()

    history = tpudist.fit(model, loader, opt, torch.nn.functional.cross_entropy, epochs=3)

    step = tpudist.compile_train_step(model, loss_fn, opt)   # one XLA executable per step
    loss = step((x_local, y_local))

`fit` runs the fused step (`compile_train_step`, in `tpudist/compile/_torch/train/_fused.py`) by default
and takes any other per-batch step as `step_fn` (`eager_step`: eager torch plus `optimizer_step`).
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tpudist import _metrics
from tpudist._runtime import process_count, process_index
from tpudist.collectives import all_gather, all_reduce
from tpudist.compile._efficiency import Goodput, device_peak_flops
from tpudist.compile._torch.train import _fit_io, _resume
from tpudist.compile._torch.train._fit_report import compile_seconds, epoch_record, examples_in, tokens_in
from tpudist.compile._torch.train._loader import device_loader
from tpudist.compile._torch._custom_ops import SHARDED_ATTR

__all__ = ["optimizer_step", "fit", "eager_step"]

StepFn = Callable[[Any], torch.Tensor]


def optimizer_step(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[int]] | None = None,
                   optimizer_args: dict[str, Any] | None = None) -> Any:
    """Averages every parameter's `.grad` over the processes, then calls `optimizer.step()`.

    Like torch_xla's `xm.optimizer_step`: call it on every process after `loss.backward()`. All
    gradients travel in one collective per dtype (coalesced), and the means are written back into
    `.grad` in place. Parameters whose `.grad` is None are skipped; every process must have grads
    for the same parameters (the collective's signature check reports a mismatch). With `groups`
    (e.g. [[0, 1], [2, 3]]) each group averages on its own.

    Parameters of `tpudist.nn.ShardedEmbedding` hold one process's rows, and their backward already
    summed the gradient over processes; they are not all-reduced but divided by the process count,
    so every parameter sees the gradient of the mean of the processes' losses. Returns what
    `optimizer.step()` returns. Example::

        loss_fn(model(x_local), y_local).backward()
        tpudist.optimizer_step(opt)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_step takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    replicated, sharded = [], []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            (sharded if getattr(p, SHARDED_ATTR, False) else replicated).append(p)
    if sharded and groups is not None:
        raise ValueError("optimizer_step(groups=...) cannot be combined with ShardedEmbedding parameters: "
                         "their rows are split over all processes, not per group; drop groups=")
    if any(p.grad.is_sparse for p in replicated):
        raise TypeError("optimizer_step averages dense gradients; a parameter has a sparse .grad "
                        "(nn.Embedding(sparse=True)?): use sparse=False or tpudist.nn.ShardedEmbedding")
    if replicated:
        means = all_reduce([p.grad for p in replicated], op="mean", groups=groups)
        with torch.no_grad():
            for p, mean in zip(replicated, means):
                p.grad.copy_(mean)
    if sharded:
        count = process_count()
        with torch.no_grad():
            for p in sharded:
                p.grad.div_(count)
    return optimizer.step(**(optimizer_args or {}))


def eager_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
               optimizer: torch.optim.Optimizer, *, accumulate_steps: int = 1) -> StepFn:
    """A step for `fit(step_fn=...)`: eager forward and backward, then `optimizer_step`.

    The returned function takes one batch, a tuple or list `(*inputs, target)`, runs
    `loss_fn(model(*inputs), target)`, and returns this process's loss (detached). With
    `loss_fn=None` the batch is what the model takes and the model returns its loss, as in
    `compile_train_step`. `accumulate_steps=K` splits the batch into K micro-batches whose
    gradients are averaged before the one update. Example::

        step = eager_step(model, torch.nn.functional.mse_loss, opt)
        loss = step((x, y))
    """
    from tpudist.compile._torch.train._plan import call_model, model_loss

    def loss_of(batch: Any) -> torch.Tensor:
        if loss_fn is None:
            return model_loss(call_model(model, batch))
        return loss_fn(model(*batch[:-1]), batch[-1])

    def step(batch: Any) -> torch.Tensor:
        if loss_fn is not None and (not isinstance(batch, (tuple, list)) or len(batch) < 2):
            raise TypeError(f"rank {process_index()}: fit's default step takes batches (*inputs, "
                            f"target), got {type(batch).__name__}"
                            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                            + "; pass loss_fn=None if the model computes its loss, or step_fn= for other layouts")
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in split_batch(batch, accumulate_steps):
            loss = loss_of(micro) / accumulate_steps
            loss.backward()
            total = total + loss.detach()
        optimizer_step(optimizer)
        return total
    return step


def split_batch(batch: Any, parts: int) -> list[Any]:
    """`batch` (any pytree of tensors with a leading batch dim) as `parts` equal slices."""
    if parts == 1:
        return [batch]
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    chunks = [leaf.chunk(parts) if isinstance(leaf, torch.Tensor) else [leaf] * parts for leaf in leaves]
    if any(len(c) != parts for c in chunks):
        raise ValueError(f"a batch with leading sizes {[l.shape[0] for l in leaves if isinstance(l, torch.Tensor)]} "
                         f"does not split into accumulate_steps={parts} micro-batches")
    return [torch.utils._pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(parts)]


def concat_batches(batches: list[Any]) -> Any:
    """Batches of one structure joined along their leading dim (one step's K micro-batches)."""
    if len(batches) == 1:
        return batches[0]
    flat = [torch.utils._pytree.tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError("fit(accumulate_steps=...): consecutive batches have different structures")
    leaves = [torch.cat(ls) if isinstance(ls[0], torch.Tensor) else ls[0] for ls in zip(*(l for l, _ in flat))]
    return torch.utils._pytree.tree_unflatten(leaves, spec)


# fit's fused steps, kept per model so that calling fit once per epoch (to evaluate or step an LR
# schedule in between) compiles once, not once per call
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fused_step_for(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                    optimizer: torch.optim.Optimizer, accumulate_steps: int, mesh: Any = None,
                    sharding: Any = None) -> StepFn:
    steps = _FUSED.setdefault(model, {})
    key = (id(loss_fn), id(optimizer), accumulate_steps, id(mesh), repr(sharding))
    if key not in steps or steps[key][0] is not loss_fn or steps[key][1] is not optimizer:
        from tpudist.compile._torch.train._fused import compile_train_step
        steps[key] = (loss_fn, optimizer, compile_train_step(model, loss_fn, optimizer, mesh=mesh, sharding=sharding,
                                                             accumulate_steps=accumulate_steps))
    return steps[key][2]


def _checked_step(step: StepFn, batch: Any, fused: bool) -> torch.Tensor:
    if not fused:
        return step(batch)
    from tpudist.compile._torch import CaptureError, UnsupportedOpError
    try:
        return step(batch)
    except (UnsupportedOpError, CaptureError) as e:
        raise type(e)(f"{e} [tpudist.fit compiles the model and its update into one XLA step; to train this "
                      "model in eager torch instead pass step_fn=tpudist.eager_step(model, loss_fn, optimizer)]") from e


def _my_batches(loader: Iterable[Any], rank: int, count: int) -> Iterator[Any]:
    """Batch i goes to process i % count; a last round with fewer than `count` batches is dropped
    so that every process runs the same number of steps (their collectives must line up)."""
    mine = None
    for i, batch in enumerate(loader):
        if i % count == rank:
            mine = batch
        if i % count == count - 1:
            yield mine


def _grouped(batches: Iterable[Any], size: int) -> Iterator[Any]:
    """Every `size` consecutive batches as one (concatenated); a last, smaller group is dropped."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield concat_batches(group)
            group = []


def _check_lengths(loader: Iterable[Any], shard: bool) -> int | None:
    """Steps per epoch for the progress bar (None without len); ValueError if processes differ."""
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
    lengths = all_gather(torch.tensor([length], dtype=torch.int64)).tolist()
    if len(set(lengths)) > 1:
        raise ValueError(f"fit: the loaders have different lengths on different processes ({lengths}, by rank); "
                         "every process must run the same number of steps"
                         + (" (shard=True: give every process the same loader, with the same shuffle seed)"
                            if shard else " (shard=False: split the data evenly, e.g. DistributedSampler(drop_last=True))"))
    return length // process_count() if shard else length


def fit(model: torch.nn.Module, loader: Iterable[Any], optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None = None, epochs: int = 1, *, step_fn: StepFn | None = None,
        shard: bool = True, accumulate_steps: int = 1, lr_scheduler: Any = None,
        checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
        log_dir: str | None = None, profile_steps: tuple[int, int] | None = None,
        progress: bool | None = None, log: bool = True, mesh: Any = None,
        sharding: Any = None) -> list[dict[str, float]]:
    """Trains `model` data-parallel across every process; returns one record per epoch.

    Call it on every process. With `shard=True` every process iterates the same `loader` (same
    batches, same order: seed any shuffling identically) and trains on batch i if
    i % process_count == its rank, so each step's global batch is process_count loader batches;
    a last round with fewer batches than processes is dropped so every process runs the same
    number of steps. With `shard=False` the loader is already this process's share (e.g. with a
    `DistributedSampler(drop_last=True)`) and must have the same length on every process.

    Each step is `step_fn(batch) -> local loss`; the default, `compile_train_step(model, loss_fn,
    optimizer)`, is the fused XLA step (forward, backward, gradient all-reduce and update in one
    executable; SGD, Adam, AdamW). `step_fn=tpudist.eager_step(model, loss_fn, optimizer)` runs
    eager torch with `optimizer_step` instead (any optimizer, any model torch.export cannot
    capture). Batches are `(*inputs, target)` for both; with `loss_fn=None` a batch is what the
    model takes (a dict of keyword arguments, as a Hugging Face model's, `labels` included) and
    the model returns its loss (`output.loss`). `accumulate_steps=K` makes every K consecutive
    batches of a process one optimizer step (their gradients averaged, as `loss / K` then
    `backward()` K times in torch would); a last group of fewer than K batches is dropped.
    `lr_scheduler.step()` runs once per optimizer step. `mesh` and `sharding` go to
    `compile_train_step` (FSDP and tensor parallelism, docs/sharding.md); checkpoints then hold each
    process's shards.

    With `checkpoint_dir` (fused step only) the whole training state (model, optimizer, scheduler,
    epoch and position in the loader, RNG states) is saved there every `checkpoint_every`
    optimizer steps (asynchronously) and at the end, with `tpudist.checkpoint` (orbax); and if the
    directory already holds a checkpoint, training resumes from it, whatever the model's current
    values: a job restarted after a failure (`--max-restarts`) ends bit-identical to one that was
    never interrupted. A SIGTERM (a maintenance event, the launcher stopping the job) then makes
    every process save at the same step (agreed inside the step's all-reduce) and exit with status
    143. Records of a resumed epoch cover the steps run since the resume. A checkpoint resumed by
    another number of processes (the launcher's `--min-hosts` dropped a host) keeps its global
    batch: each process takes more (or fewer) accumulation steps, said on rank 0.

    With `log_dir`, rank 0 writes TensorBoard scalars there (`train/loss` and `train/lr` per
    step, written at each epoch's end when the losses are read anyway; `epoch/loss`,
    `epoch/examples_per_s`, `epoch/step_ms`, `epoch/compile_s` per epoch: `tpudist.read_scalars`
    reads them back), and `profile_steps=(A, B)` records a trace of steps A..B-1 (0-based, counted
    over the whole run) on every process under `log_dir/rank<R>/` (TensorBoard's profile plugin,
    Perfetto). The launcher's `--profile DIR --profile-steps A:B` sets this for every process
    (`TPUDIST_PROFILE_DIR`, `TPUDIST_PROFILE_STEPS`) and copies the traces back.

    Rank 0 shows progress (loss, examples/s) when `progress` is True, or None and stderr is a
    terminal or the launcher's console is (it sets TPUDIST_CONSOLE=tty): a bar on a terminal, else
    (stderr the launcher's pipe) a line after the first step, then at most one every 10 s. With
    `log`, rank 0 says when the first call compiles the fused step and prints one line per epoch,
    its compile time apart. Each record: {"epoch",
    "loss" (mean over steps and processes of the local losses), "examples" (all processes),
    "seconds", "examples_per_s", "compile_seconds" (capture and XLA compilation within the epoch),
    and the efficiency report: "tokens", "tokens_per_s", "flops_per_step", "mfu", "goodput",
    "data_seconds", "checkpoint_seconds" (docs/torch_training.md, "Efficiency")}.
    Example::

        history = tpudist.fit(model, loader, torch.optim.Adam(model.parameters()), F.mse_loss, epochs=2)
        history[-1]["loss"]
        tpudist.fit(bert, hf_loader, torch.optim.AdamW(bert.parameters(), lr=5e-5))   # the model's loss
        tpudist.fit(model, loader, opt, F.cross_entropy, 10, lr_scheduler=sched,
                    checkpoint_dir="/ckpt/run1", checkpoint_every=500)              # restartable
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be a positive int")
    if not isinstance(accumulate_steps, int) or isinstance(accumulate_steps, bool) or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps={accumulate_steps!r} must be a positive int")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every={checkpoint_every!r} must be a positive int or None")
    if checkpoint_dir is not None and step_fn is not None:
        raise ValueError("fit(checkpoint_dir=...) checkpoints the fused step's device state; with step_fn= save "
                         "model.state_dict() and optimizer.state_dict() with tpudist.checkpoint.save yourself")
    if step_fn is not None and (mesh is not None or sharding is not None):
        raise ValueError("fit(mesh=, sharding=) configure the fused step; with step_fn= build your step with them")
    rank, count = process_index(), process_count()
    saved = _resume.read_saved(checkpoint_dir) if checkpoint_dir is not None else None
    if saved is not None:  # a restart over fewer hosts (--min-hosts) keeps the global batch
        accumulate_steps = _resume.resumed_accumulation(checkpoint_dir, saved, count, accumulate_steps, shard, rank)
    fused = step_fn is None
    step = step_fn if step_fn is not None else _fused_step_for(model, loss_fn, optimizer, accumulate_steps,
                                                                mesh, sharding)
    total = _check_lengths(loader, shard)
    if total is not None:
        total //= accumulate_steps
    saver = _resume.Checkpointer(checkpoint_dir, step, optimizer, lr_scheduler, loader,
                                 _resume.Layout(count, accumulate_steps), saved) if checkpoint_dir else None
    scalars = _metrics.ScalarLog(log_dir, rank) if log_dir is not None else None
    tracer = _fit_io.StepProfile.from_settings(log_dir, profile_steps)
    run = Goodput()  # the whole call's, for the line that ends it
    started = time.perf_counter()
    with run.checkpointing():
        at = (saver.restore() if saver else None) or _resume.Progress()
    resumed, first_step = at.position > 0, at.global_step
    terminal = sys.stderr.isatty()
    bar = _fit_io.Progress(rank == 0 and _fit_io.shows_progress(progress, terminal), log and rank == 0, terminal)
    history: list[dict[str, float]] = []
    peak, peak_source = device_peak_flops()
    model.train()
    with _resume.stop_on_sigterm(step if saver else None) as stopping:
        try:
            for epoch in range(at.epoch, epochs + 1):
                at.epoch = epoch
                if saver is not None:
                    saver.replay_epoch_start() if resumed else saver.epoch_started()
                bar.epoch(epoch, epochs, total)
                losses: list[Any] = []  # on the devices until the epoch's end: no step waits for its loss
                examples, tokens = 0, 0
                clock = Goodput()
                start, compiled = time.perf_counter(), compile_seconds(step)
                batches: Iterator[Any] = _grouped(_my_batches(loader, rank, count) if shard else loader, accumulate_steps)
                if resumed:  # the batches trained on before the restart
                    batches = itertools.islice(batches, at.position, None)
                if fused:  # each batch moves to the devices while the step before it runs
                    batches = device_loader(batches, mesh=step.mesh)
                lrs: list[float] = []
                try:
                    for batch in clock.waited(batches):
                        tracer.before(at.global_step)
                        if resumed and saver is not None:
                            saver.resume_rng()  # the loader has drawn its shuffle: torch's state of the checkpoint
                            resumed = False
                        lrs.append(float(optimizer.param_groups[0]["lr"]))
                        if fused and not step.stats.calls:
                            bar.compiling()
                        losses.append(_checked_step(step, batch, fused=fused))
                        at.position += 1
                        at.global_step += 1
                        tracer.after(at.global_step)
                        if lr_scheduler is not None:
                            lr_scheduler.step()
                        examples += examples_in(batch)
                        counted = tokens_in(batch)
                        tokens = tokens + counted if counted is not None and tokens >= 0 else -1
                        # the rate of training, its compile left out (the first step's line would say 7/s)
                        busy = time.perf_counter() - start - (compile_seconds(step) - compiled)
                        bar.update(losses, examples * count / max(busy, 1e-9))
                        if saver is not None and stopping.agreed(step.signal):
                            with clock.checkpointing():
                                saver.save(at, wait=True)
                            raise _resume.Stopped(at.global_step)
                        if saver is not None and checkpoint_every and at.global_step % checkpoint_every == 0:
                            with clock.checkpointing():
                                saver.save(at, wait=False)
                finally:
                    if fused:
                        batches.close()
                resumed = False
                loss_sum, steps = sum(float(loss) for loss in losses), len(losses)  # (waits for the last step)
                clock.wall_s, clock.compile_s = time.perf_counter() - start, compile_seconds(step) - compiled
                # the slowest process's: every other one waits for it in the step's all-reduce
                slowest = all_reduce(torch.tensor([clock.compile_s, clock.checkpoint_s, clock.data_s],
                                                  dtype=torch.float64), op="max")
                clock.compile_s, clock.checkpoint_s, clock.data_s = slowest.tolist()
                run.add(clock)
                # One collective per epoch, not per step: the history's loss, example and token counts.
                totals = all_reduce(torch.tensor([loss_sum, examples, steps, max(tokens, 0), tokens < 0],
                                                 dtype=torch.float64), op="sum")
                flops = getattr(getattr(step, "stats", None), "flops_per_step", None)
                record = epoch_record(epoch, totals.tolist(), clock, steps, flops, peak)
                history.append(record)
                if scalars is not None:
                    _fit_io.write_scalars(scalars, record, losses, lrs, at.global_step, step)
                bar.end_epoch(record, epochs)
                _fit_io.report_goodput(rank, run, time.perf_counter() - started, first_step, at.global_step)
                at.position = 0
            if saver is not None:
                with run.checkpointing():
                    saver.save(at, wait=True)
        except _resume.Stopped as stopped:
            if rank == 0:
                print(f"fit: stopped by SIGTERM after step {stopped.step}; the checkpoint is in {checkpoint_dir}",
                      file=sys.stderr, flush=True)
            raise SystemExit(143) from None
        finally:
            bar.close()
            tracer.close()
            if scalars is not None:
                scalars.close()
            if fused:
                step.sync()  # the model and optimizer hold the trained values (one copy, not per step)
    run.wall_s = time.perf_counter() - started
    bar.end_run(run, history, peak_source if peak is None else None)
    _fit_io.report_goodput(rank, run, run.wall_s, first_step, at.global_step)
    return history
