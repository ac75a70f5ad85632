"""Benchmark: one training step (forward + backward) of each reference model, compiled through
tpudist's torch -> XLA bridge vs eager torch, side by side in one run, on this machine's CPU.

    python scripts/bench_torch.py                       # all models, batch 64 and 256
    python scripts/bench_torch.py --models mlp --batches 64 --json bench-results/torch.json

A step is `zero_grad(); loss = model_with_loss(*inputs, target); loss.backward()` for both sides
(the optimizer update is the same torch code for both and is left out). Each side runs warm-up
steps (the compiled side compiles in the first), then `--repeats` timed runs of `--steps` steps;
the best run is reported, since on a shared machine noise only ever adds time, and the two
sides alternate run by run so that load from other processes hits both alike.
Prints a table, then the JSON (also written to --json when given).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpudist  # noqa: E402
from torch_models import REFERENCES, WithLoss  # noqa: E402


def _time_interleaved(steps_by_side: dict[str, Callable[[], None]], steps: int, repeats: int) -> dict[str, float]:
    """Best mean seconds per step of each side over `repeats` runs of `steps` steps. The sides
    alternate run by run, so a burst of load from other processes hits both alike."""
    best = {side: float("inf") for side in steps_by_side}
    for _ in range(repeats):
        for side, step in steps_by_side.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best[side] = min(best[side], (time.perf_counter() - start) / steps)
    return best


def _step_fn(module: torch.nn.Module, params: list[torch.nn.Parameter], inputs: tuple, target: torch.Tensor):
    def step() -> None:
        for p in params:
            p.grad = None
        module(*inputs, target).backward()
    return step


def bench_model(name: str, batch: int, steps: int, repeats: int, warmup: int) -> dict[str, Any]:
    """One row: eager and compiled ms/step for `name` at `batch`, plus the compiled side's compile time."""
    ref = REFERENCES[name]
    torch.manual_seed(0)
    model = ref.build("bench")
    inputs, target = ref.batch("bench", batch, torch.Generator().manual_seed(0))
    eager = WithLoss(copy.deepcopy(model), ref.loss)
    compiled = tpudist.compile(WithLoss(model, ref.loss))

    eager_step = _step_fn(eager, list(eager.parameters()), inputs, target)
    compiled_step = _step_fn(compiled, list(model.parameters()), inputs, target)
    start = time.perf_counter()
    compiled_step()  # capture + XLA compile of forward and backward
    first_call = time.perf_counter() - start
    for _ in range(warmup):
        eager_step()
        compiled_step()
    times = _time_interleaved({"eager": eager_step, "compiled": compiled_step}, steps, repeats)
    eager_s, compiled_s = times["eager"], times["compiled"]
    assert compiled.stats.compiles == 1, compiled.stats
    return {
        "model": name, "batch": batch,
        "params": sum(p.numel() for p in model.parameters()),
        "eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3,
        "speedup": eager_s / compiled_s,
        "first_call_s": first_call, "capture_s": compiled.stats.capture_seconds,
    }


def bench_fused_data_parallel(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Hook for the second half of this benchmark: the fused data-parallel step
    (`tpudist.compile_train_step`: forward, backward, in-graph gradient all-reduce and optimizer
    update in one XLA executable) over 2 processes vs torch DDP (gloo) on the same global batch.
    It needs the runtime's collectives and `tpudist.spawn`; until they exist it reports why not."""
    try:
        tpudist.compile_train_step  # noqa: B018
        tpudist.spawn  # noqa: B018
    except (AttributeError, ImportError) as exc:
        return [{"fused": "skipped", "reason": f"{type(exc).__name__}: {exc}"}]
    return [{"fused": "skipped", "reason": "fused data-parallel benchmark not written yet"}]


def _table(rows: list[dict[str, Any]]) -> str:
    header = f"{'model':<14}{'batch':>6}{'params':>10}{'eager ms':>11}{'compiled ms':>13}{'speedup':>9}{'1st call s':>12}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['batch']:>6}{r['params']:>10}{r['eager_ms']:>11.2f}"
                     f"{r['compiled_ms']:>13.2f}{r['speedup']:>8.2f}x{r['first_call_s']:>12.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(REFERENCES), choices=sorted(REFERENCES))
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per side; the best is kept")
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads for the eager side "
                        "(default: torch's own choice; with other processes on the cores, fewer threads can be faster)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    load_before = list(os.getloadavg())
    rows = []
    for name in args.models:
        for batch in args.batches:
            rows.append(bench_model(name, batch, args.steps, args.repeats, args.warmup))
            print(f"  {name} batch {batch}: eager {rows[-1]['eager_ms']:.2f} ms, "
                  f"compiled {rows[-1]['compiled_ms']:.2f} ms", file=sys.stderr, flush=True)
    import jax
    result = {
        "benchmark": "torch forward+backward step: tpudist.compile (XLA) vs eager torch",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()],
                    "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
        "settings": {"steps": args.steps, "repeats": args.repeats, "warmup": args.warmup},
        "rows": rows,
        "fused_data_parallel": bench_fused_data_parallel(args),
    }
    print(_table(rows))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
