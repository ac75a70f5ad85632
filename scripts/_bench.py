"""The benchmarks' one harness: interleaved timing with medians, one table printer, one JSON/PNG writer.

    import _bench                                     # from a script in scripts/
    times = _bench.interleave({"eager": eager_step, "compiled": compiled_step}, rounds=10, steps=3)
    row = {"eager_ms": times["eager"].median * 1e3, "compiled_ms": times["compiled"].median * 1e3}
    print(_bench.table([row], [("eager ms", "eager_ms", ".2f"), ("compiled ms", "compiled_ms", ".2f")]))
    out = _bench.Output.from_args(args)               # --json (bench-results/<name>.json), --no-plot
    out.write({"rows": [row]}, announce=True)
    out.picture(lambda png: _plots.time_bars([row], png, keys=["eager_ms", "compiled_ms"]))

The sides being compared (the anchor among them) run in the same process and the same run, one
timed run of each per round (A B A B ...), so that a burst of load from another tenant of the
machine hits every side alike; each side's time is the median over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

RESULTS = Path("bench-results")
# Untimed steps of a side before each of its timed runs. Measured: after the cores ran one thread
# (eager torch at 1 thread) or slept for 0.5 s, the first ~10 steps of a transformer block's XLA
# step (2 threads) took 1.5-3x as long as the rest (30-60 ms in all), so a side timed right after
# eager torch paid for it.
SETTLE_S = 0.15
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def _nothing(*_: Any) -> None:
    return None


# -- timing -----------------------------------------------------------------------------------------

@dataclass
class Side:
    """One side of a comparison: `step` runs one step, `wait(result)` waits for it (an asynchronous
    result: a LazyScalar, a JAX array), `around()` is held over each timed run (e.g. a profile on),
    `steps` overrides the steps per run of `interleave`."""

    step: Callable[[], Any]
    wait: Callable[[Any], Any] = _nothing
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    steps: int | None = None


@dataclass
class Timing:
    """One side's samples, seconds per step: one per timed run (or per call with `per_call`), of
    wall time, the calling thread's CPU and the whole process's CPU (less moved than wall time by
    other tenants of a shared machine)."""

    wall: list[float] = field(default_factory=list)
    thread: list[float] = field(default_factory=list)
    process: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def thread_median(self) -> float:
        return statistics.median(self.thread)

    @property
    def process_median(self) -> float:
        return statistics.median(self.process)


def alternate(sides: Mapping[K, Callable[[], T]], rounds: int, *, shuffle: bool = False,
              before: Callable[[], Any] = _nothing) -> dict[K, list[T]]:
    """Each side called once per round, in turn (A B A B ...), `before()` ahead of each call; with
    `shuffle`, the order drawn anew each round (seeded: the same in every process), so that no side
    always runs right after the same one and carries its after-effects. Returns every call's
    result, by side: the building block for measurements that are not plain step times."""
    results: dict[K, list[T]] = {k: [] for k in sides}
    order, rng = list(sides), random.Random(0)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for k in order:
            before()
            results[k].append(sides[k]())
    return results


def interleave(sides: Mapping[str, Side | Callable[[], Any]], *, rounds: int, steps: int = 1,
               warmup: int = 0, settle_s: float = 0.0, shuffle: bool = False, per_call: bool = False,
               before_run: Callable[[], Any] = _nothing, sync: Callable[[], Any] = _nothing) -> dict[str, Timing]:
    """Times each side's step: `warmup` untimed steps of each, then `rounds` rounds of one timed run
    of `steps` steps per side (see `alternate`). Before each run, `settle_s` seconds of the side's
    untimed steps (see SETTLE_S; time-based, so not for steps that hold collectives across
    processes), then `before_run()` (e.g. a barrier) and `sync()` (a GPU's queue). A run ends when its last
    result is ready and `sync()` returned; with `per_call`, every step is waited for and timed alone."""
    sides = {name: s if isinstance(s, Side) else Side(s) for name, s in sides.items()}
    for _ in range(warmup):
        for side in sides.values():
            side.wait(side.step())
    timings = {name: Timing() for name in sides}

    def run(name: str) -> Callable[[], None]:
        def timed() -> None:
            side, timing = sides[name], timings[name]
            with side.around():
                _settle(side, settle_s)
                before_run()
                sync()
                for wall, thread, process in _timed_run(side, side.steps or steps, per_call, sync):
                    timing.wall.append(wall)
                    timing.thread.append(thread)
                    timing.process.append(process)
        return timed

    alternate({name: run(name) for name in sides}, rounds, shuffle=shuffle)
    return timings


def _settle(side: Side, seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        side.wait(side.step())


def _timed_run(side: Side, steps: int, per_call: bool, sync: Callable[[], Any]) -> list[tuple[float, float, float]]:
    clocks = (time.perf_counter, time.thread_time, time.process_time)
    if per_call:
        samples = []
        for _ in range(steps):
            start = [c() for c in clocks]
            side.wait(side.step())
            sync()
            samples.append(tuple(c() - s for c, s in zip(clocks, start)))
        return samples
    start = [c() for c in clocks]
    result = None
    for _ in range(steps):
        result = side.step()
    side.wait(result)
    sync()
    return [tuple((c() - s) / steps for c, s in zip(clocks, start))]


def first_call(fn: Callable[[], T], sync: Callable[[], Any] = _nothing) -> tuple[T, float]:
    """`fn()`'s result and its seconds, `sync()` included: a first call, where compiles happen."""
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


# -- tables -----------------------------------------------------------------------------------------

def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def _cell(row: Mapping[str, Any], key: str | Callable[[Mapping[str, Any]], Any], fmt: str) -> str:
    value = key(row) if callable(key) else row.get(key)
    if value is None:
        return "-"
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt == "bytes":
        return human_bytes(value)
    return str(value) if fmt in ("", "s") else format(value, fmt)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple], title: str | None = None) -> str:
    """`rows` as aligned columns, a rule under the header, `title` above. Each column is
    (header, key) or (header, key, fmt): key a row key or a function of the row; fmt a format spec
    (".3f", "d"), "x" (a ratio: 2 decimals and an x), "bytes" (KiB, MiB), "s" (text, left-aligned)
    or "" (str, the default). A missing or None value prints as "-"."""
    columns = [(c[0], c[1], c[2] if len(c) > 2 else "") for c in columns]
    cells = [[_cell(r, key, fmt) for _, key, fmt in columns] for r in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (header, _, _) in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if fmt == "s" else v.rjust(w)
                         for v, w, (_, _, fmt) in zip(values, widths, columns)).rstrip()
    lines = [title] if title else []
    lines += [line([h for h, _, _ in columns]), line(["-" * w for w in widths])] + [line(c) for c in cells]
    return "\n".join(lines)


# -- results: JSON and PNG --------------------------------------------------------------------------

def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--json PATH (default bench-results/<name>.json) and --no-plot, read by `Output.from_args`."""
    parser.add_argument("--json", type=Path, default=RESULTS / f"{name}.json",
                        help=f"where the results go (default: {RESULTS / name}.json; the PNG beside it)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG beside the JSON")


def machine() -> dict[str, Any]:
    """What every result file records about the machine it ran on."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}


class Output:
    """Where a run's results go: the JSON at `path` (rewrite it as rows arrive, so that an
    interrupted run keeps what it measured) and the PNG beside it (same stem)."""

    def __init__(self, path: str | Path, plot: bool = True):
        self.path, self.plot = Path(path), plot
        self._load_before = list(os.getloadavg())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Output:
        return cls(args.json, not args.no_plot)

    def write(self, doc: Mapping[str, Any], *, announce: bool = False) -> Path:
        """`doc` as JSON, with the command line and a "machine" entry (this machine, the load
        average before the run and now; `doc`'s own "machine" keys added to it)."""
        about = {**machine(), "load_average_before": self._load_before,
                 "load_average_after": list(os.getloadavg()), **doc.get("machine", {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"argv": sys.argv, **doc, "machine": about}, indent=2, default=str) + "\n")
        if announce:
            print(f"JSON: {self.path}")
        return self.path

    def picture(self, draw: Callable[[Path], Any]) -> Path | None:
        """`draw(png)` unless --no-plot; prints the PNG's path, or why there is none (no matplotlib)."""
        if not self.plot:
            return None
        png = self.path.with_suffix(".png")
        try:
            draw(png)
        except ImportError as error:
            print(f"no PNG: {error} (pip install -e .[bench] for matplotlib)")
            return None
        print(f"PNG: {png}")
        return png


# -- the example models -----------------------------------------------------------------------------

def example(name: str) -> ModuleType:
    """examples/<name>.py as module `name` (examples/ is not a package, and sys.path stays as it is)."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module
