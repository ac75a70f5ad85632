"""What `fit` shows and records: the progress bar and epoch lines, TensorBoard scalars, a trace of
chosen steps."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from tpudist import contract


LINE_EVERY_S = 10.0  # a progress line at most this often where stderr is not a terminal (the launcher's pipe)


def shows_progress(progress: bool | None, terminal: bool) -> bool:
    """fit's `progress`: None shows it where stderr is a terminal, or where it is the launcher's pipe
    and the launcher's own console is one (TPUDIST_CONSOLE=tty)."""
    if progress is not None:
        return progress
    return terminal or os.environ.get(contract.CONSOLE) == "tty"


class Progress:
    """Rank 0's progress: a rich bar when stderr is a terminal, whole lines when it is not (under the
    launcher, whose console prints each process's lines): the first after the first step (its
    compile done), then at most every LINE_EVERY_S seconds; and, with `log`, one line per epoch."""

    def __init__(self, enabled: bool, log: bool, terminal: bool = True):
        self.log = log
        self.bar = None
        self.lines = enabled and not terminal
        self._last_line = float("-inf")  # the first step prints one
        self._title, self._total, self._done = "", None, 0
        if enabled and terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("{task.fields[info]}"), transient=True)
            self.bar.start()

    def epoch(self, epoch: int, epochs: int, total: int | None) -> None:
        self.start(f"epoch {epoch}/{epochs}", total)

    def start(self, title: str, total: int | None) -> None:
        """A new task on the bar: `title`, `total` steps (None: unknown)."""
        self._title, self._total, self._done = title, total, 0
        if self.bar is not None:
            self.task = self.bar.add_task(self._title, total=total, info="")

    def update(self, losses: list[Any], rate: float) -> None:
        self._done += 1
        if self.bar is None and not self.lines:
            return
        now = time.monotonic()
        if self.bar is None and now - self._last_line < LINE_EVERY_S:
            return
        # the newest loss the devices have finished: progress never waits for a step
        done = next((loss for loss in reversed(losses) if not hasattr(loss, "ready") or loss.ready()), None)
        info = f"loss {float(done):.4g} (rank 0)  " if done is not None else ""
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=f"{info}{rate:,.0f} examples/s")
        else:
            self._last_line = now
            of = f"/{self._total}" if self._total is not None else ""
            print(f"{self._title}: step {self._done}{of}, {info}{rate:,.0f} examples/s", file=sys.stderr, flush=True)

    def compiling(self) -> None:
        """Says that the first call compiles (seconds to minutes of a first step), before it does."""
        if self.log:
            print("fit: compiling the step (its first call; the steps after reuse it) ...", file=sys.stderr, flush=True)

    def end_epoch(self, record: dict[str, float], epochs: int) -> None:
        if self.bar is not None:
            self.bar.remove_task(self.task)
        if self.log:
            compiling = f", of which compiling {record['compile_seconds']:.2f} s" if record["compile_seconds"] else ""
            tokens = f", {record['tokens_per_s']:,.0f} tokens/s" if record["tokens_per_s"] is not None else ""
            mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
            print(f"epoch {record['epoch']}/{epochs}: loss {record['loss']:.6g}, "
                  f"{record['examples_per_s']:,.0f} examples/s{tokens}, MFU {mfu}, goodput "
                  f"{100 * record['goodput']:.0f}% ({record['examples']} examples in {record['seconds']:.2f} s"
                  f"{compiling})", file=sys.stderr, flush=True)

    def end_run(self, run: Any, history: list[dict[str, Any]], no_peak: str | None) -> None:
        """The line that ends `fit` (with `log`): the run's goodput, and why MFU is n/a if it is."""
        if not self.log or not history:
            return
        flops = history[-1]["flops_per_step"]
        work = f"; {flops / 1e9:,.3g} GFLOPs per step and device" if flops is not None else ""
        why = f"; MFU n/a: {no_peak}" if no_peak else ""
        print(f"fit: {run.describe()}{work}{why}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def report_goodput(rank: int, run: Any, wall_s: float, first_step: int, global_step: int) -> None:
    """Under the launcher (its agent gives each process a private directory), rank 0's goodput so
    far as one line on stderr, which the launcher reads and the console does not show
    (contract.GOODPUT_REPORT)."""
    if rank != 0 or not os.environ.get(contract.DEBUG_DIR):
        return
    fields = {"attempt": int(os.environ.get(contract.RESTART) or 0), "wall_s": wall_s,
              "compile_s": run.compile_s, "data_s": run.data_s, "checkpoint_s": run.checkpoint_s,
              "first_step": first_step, "global_step": global_step}
    print(contract.GOODPUT_REPORT + json.dumps(fields), file=sys.stderr, flush=True)


def write_scalars(scalars: Any, record: dict[str, float], losses: list[Any], lrs: list[float],
                   global_step: int, step: Any) -> None:
    """One epoch's TensorBoard scalars (rank 0): every step's loss and learning rate, the epoch's."""
    first = global_step - len(losses)
    for i, (loss, lr) in enumerate(zip(losses, lrs)):
        scalars.scalar("train/loss", float(loss), first + i + 1)
        scalars.scalar("train/lr", lr, first + i + 1)
    scalars.scalar("epoch/loss", record["loss"], record["epoch"])
    scalars.scalar("epoch/examples_per_s", record["examples_per_s"], record["epoch"])
    scalars.scalar("epoch/step_ms", 1e3 * record["seconds"] / max(len(losses), 1), record["epoch"])
    stats = getattr(step, "stats", None)
    if stats is not None and hasattr(stats, "compile_seconds"):
        scalars.scalar("epoch/compile_s", stats.compile_seconds + stats.capture_seconds, record["epoch"])
    scalars.scalar("epoch/goodput", record["goodput"], record["epoch"])
    for name in ("tokens_per_s", "flops_per_step", "mfu"):
        if record[name] is not None:
            scalars.scalar(f"epoch/{name}", record[name], record["epoch"])
    scalars.flush()


class StepProfile:
    """Records a trace of steps [first, last) with `tpudist.profile`'s start/stop (or nothing)."""

    def __init__(self, directory: str | None, first: int, last: int):
        self.directory, self.first, self.last = directory, first, last
        self.on = False

    @classmethod
    def from_settings(cls, log_dir: str | None, steps: tuple[int, int] | None) -> "StepProfile":
        directory = os.environ.get(contract.PROFILE_DIR) or log_dir
        text = os.environ.get(contract.PROFILE_STEPS)
        if text:
            first, _, last = text.partition(":")
            steps = (int(first), int(last))
        if steps is None or directory is None:
            return cls(None, 0, 0)
        first, last = steps
        if not 0 <= first < last:
            raise ValueError(f"profile_steps={steps!r}: give (first, last) with 0 <= first < last (steps [first, last))")
        return cls(directory, first, last)

    def before(self, step: int) -> None:
        if self.directory is not None and not self.on and step == self.first:
            from tpudist import _profile
            _profile.start_profile(self.directory)
            self.on = True

    def after(self, step: int) -> None:
        if self.on and step >= self.last:
            self.close()

    def close(self) -> None:
        if self.on:
            from tpudist import _profile
            _profile.stop_profile()
            self.on = False
