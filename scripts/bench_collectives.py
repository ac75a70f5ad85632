#!/usr/bin/env python
"""tpudist collectives vs torch.distributed (gloo), in the same processes and the same run.

For 2 and 4 processes and sizes from 4 B to 64 MiB, times tpudist's all_reduce / all_gather /
reduce_scatter on torch tensors next to torch.distributed's gloo, and prints latency, algbw,
busbw (the nccl-tests formulas) and the ratio tpudist/gloo, as a table and as JSON. Each time is
the slowest rank's median over 3 rounds, the sides interleaved round by round (scripts/_bench.py).

    python scripts/bench_collectives.py [--procs 2 4] [--min-bytes 0] [--max-bytes 64Mi] [--json out.json] [--no-plot]
                                        [--collectives all_reduce all_gather reduce_scatter]
    python scripts/bench_collectives.py --plot-only docs/bench/collectives_cpu_run6.json
    python scripts/bench_collectives.py --baseline /tmp/base --rounds 3 --max-bytes 1Mi

`--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/base HEAD~1`) measures
that tree's tpudist in the same run, alternating with this one `--rounds` times, and prints
tpudist's latency in both and the ratio this/baseline (median over rounds): what a change to the
collectives costs.

Beside the JSON it draws `<json stem>.png`: the ratio against message size, one line per collective
and process count (scripts/_plots.py; needs matplotlib, the `bench` extra). `--plot-only JSON`
draws an earlier run's picture without running anything.

Size is the full buffer, as in nccl-tests: all_reduce's input, all_gather's output,
reduce_scatter's input. busbw = algbw * 2(n-1)/n for all_reduce and (n-1)/n for the others.

The "xla" column is a diagnostic: the same collective as a bare pre-compiled XLA executable on
arrays already on the device (no conversion, no checks), i.e. the floor of XLA's gloo collectives;
tpudist minus xla is tpudist's own overhead.

The "gloo+copy" column (all_reduce only) is another diagnostic: torch's all_reduce reduces in
place, tpudist's returns a new tensor and leaves its input as it was; `dist.all_reduce(x.clone())`
is torch doing what tpudist does. The ratio stays against plain gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _bench
import _plots
import tpudist

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _parse_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(text[:-2]) * mult
    return int(text)


def sizes(max_bytes: int, min_bytes: int = 0) -> list[int]:
    ladder = [4, 64, 1 << 10, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20]
    return [s for s in ladder if min_bytes <= s <= max_bytes]


def _iters(nbytes: int, budget: float) -> int:
    # Rough cost model so small sizes get many repetitions and 64 MiB a few.
    guess = 2e-4 + nbytes / 5e8
    return int(min(500, max(3, budget / guess)))


def _bare_xla(name: str, part_elems: int, n: int):
    """A pre-compiled XLA collective on pre-placed arrays: the floor under tpudist's call."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpudist.collectives._engine import engine

    eng = engine()
    mesh = Mesh(np.array(eng.process_devices).reshape(1, n), ("g", "s"))
    spec = P("g", "s")
    body = {"all_reduce": lambda v: jax.lax.psum(v, "s"),
            "all_gather": lambda v: jax.lax.all_gather(v, "s", axis=2, tiled=True),
            "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "s", scatter_dimension=2, tiled=True)}[name]
    elems = part_elems * n if name == "reduce_scatter" else part_elems
    local = jax.device_put(np.ones((1, 1, elems), np.float32), eng.device)
    x = jax.make_array_from_single_device_arrays((1, n, elems), NamedSharding(mesh, spec), [local])
    compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(x).compile()
    return lambda: compiled(x).block_until_ready()


def measure(index: int, byte_sizes: list[int], budget: float, collectives: tuple[str, ...] = COLLECTIVES) -> list[dict]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    n = dist.get_world_size()
    rows = []
    try:
        for name in collectives:
            for nbytes in byte_sizes:
                # all_gather / reduce_scatter need a multiple of n elements; all_reduce takes any.
                elems = max(1, nbytes // 4) if name == "all_reduce" else max(n, nbytes // 4) // n * n
                full = torch.rand(elems)
                part = full[: max(1, elems // n)].clone()
                out_full = torch.empty(part.numel() * n)
                out_part = torch.empty(max(1, elems // n))
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                ops = {
                    "all_reduce": (lambda: tpudist.all_reduce(full), lambda: dist.all_reduce(full)),
                    "all_gather": (lambda: tpudist.all_gather(part), lambda: gather(out_full, part)),
                    "reduce_scatter": (lambda: tpudist.reduce_scatter(full), lambda: scatter(out_part, full)),
                }
                mine, gloo = ops[name]
                sides = {"tpudist": mine, "gloo": gloo,
                         "xla": _bare_xla(name, elems if name == "all_reduce" else elems // n, n)}
                if name == "all_reduce":
                    sides["gloo_copy"] = lambda: dist.all_reduce(full.clone())
                iters = _iters(elems * 4, budget)
                row = {"collective": name, "procs": n, "bytes": elems * 4, "iters": iters}
                times = _bench.interleave(sides, rounds=3, steps=iters, warmup=2, before_run=dist.barrier)
                for label, timing in times.items():
                    t = torch.tensor([timing.median], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
                    row[f"{label}_s"] = float(t)
                rows.append(row)
    finally:
        dist.destroy_process_group()
    return rows if index == 0 else []


def bus_factor(name: str, n: int) -> float:
    return 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n


COLUMNS = [("collective", "collective", "s"), ("procs", "procs"), ("size", "bytes", "bytes"),
           ("tpudist ms", lambda r: r["tpudist_s"] * 1e3, ".3f"), ("gloo ms", lambda r: r["gloo_s"] * 1e3, ".3f"),
           ("ratio", "ratio", ".2f"), ("algbw GB/s", "algbw_GBps", ".3f"), ("busbw GB/s", "busbw_GBps", ".3f"),
           ("gloo busbw", "gloo_busbw_GBps", ".3f"), ("xla ms", lambda r: r["xla_s"] * 1e3, ".3f"),
           ("gloo+copy ms", lambda r: r["gloo_copy_s"] * 1e3 if "gloo_copy_s" in r else None, ".3f")]
BASELINE_COLUMNS = [("collective", "collective", "s"), ("procs", "procs"), ("size", "bytes", "bytes"),
                    ("baseline ms", lambda r: r["baseline_s"] * 1e3, ".3f"),
                    ("this ms", lambda r: r["this_s"] * 1e3, ".3f"), ("this/baseline", "ratio", ".2f"),
                    ("gloo ms", lambda r: r["gloo_s"] * 1e3, ".3f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", default="64Mi")
    parser.add_argument("--min-bytes", default="0")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per measurement (approx.)")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    _bench.add_output_args(parser, "collectives")
    parser.add_argument("--plot-only", metavar="JSON", help="draw JSON's picture (JSON stem + .png) and exit")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the tpudist checked out in DIR, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = json.load(f)["rows"]
        _bench.Output(args.plot_only).picture(lambda png: plot(rows, png))
        return
    byte_sizes = sizes(_parse_bytes(args.max_bytes), _parse_bytes(args.min_bytes))
    if args.baseline:
        return compare(args)
    rows: list[dict] = []
    for n in args.procs:
        rows += tpudist.spawn(measure, args=(byte_sizes, args.budget, tuple(args.collectives)), nprocs=n,
                              cpu_devices=1, timeout=3600)[0]
    for r in rows:
        r["ratio"] = r["tpudist_s"] / r["gloo_s"]
        r["algbw_GBps"] = r["bytes"] / r["tpudist_s"] / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * bus_factor(r["collective"], r["procs"])
        r["gloo_busbw_GBps"] = r["bytes"] / r["gloo_s"] / 1e9 * bus_factor(r["collective"], r["procs"])
    print(_bench.table(rows, COLUMNS, "median time per call (the slowest rank's); ratio = tpudist / gloo"))
    out = _bench.Output.from_args(args)
    out.write({"rows": rows}, announce=True)
    out.picture(lambda png: plot(rows, png))


def compare(args: argparse.Namespace) -> None:
    """tpudist's latency in this tree and in `args.baseline`'s, alternating `args.rounds` times in one
    run; each side is this script run with that tree first on PYTHONPATH."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(tpudist.__file__)))
    trees = {"baseline": os.path.abspath(args.baseline), "this": here}
    times: dict[tuple, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(n: int, label: str) -> Callable[[], None]:
            def side() -> None:
                out = os.path.join(tmp, f"{label}.json")
                path = os.pathsep.join(filter(None, [trees[label], os.environ.get("PYTHONPATH")]))
                subprocess.run([sys.executable, os.path.abspath(__file__), "--procs", str(n), "--max-bytes",
                                args.max_bytes, "--min-bytes", args.min_bytes, "--budget", str(args.budget),
                                "--collectives", *args.collectives, "--json", out, "--no-plot"],
                               env={**os.environ, "PYTHONPATH": path}, check=True, stdout=subprocess.DEVNULL,
                               timeout=3600)
                with open(out) as f:
                    for r in json.load(f)["rows"]:
                        t = times.setdefault((r["collective"], r["procs"], r["bytes"]), {})
                        t.setdefault(label, []).append(r["tpudist_s"])
                        t.setdefault("gloo", []).append(r["gloo_s"])
            return side
        _bench.alternate({(n, label): run(n, label) for n in args.procs for label in trees}, args.rounds)
    rows = []
    for (name, n, nbytes), t in sorted(times.items()):
        row = {"collective": name, "procs": n, "bytes": nbytes,
               **{f"{label}_s": statistics.median(v) for label, v in t.items()}}
        row["ratio"] = row["this_s"] / row["baseline_s"]
        rows.append(row)
    print(_bench.table(rows, BASELINE_COLUMNS,
                       f"tpudist here and in {trees['baseline']}, median of {args.rounds} rounds"))
    _bench.Output.from_args(args).write({"baseline": trees["baseline"], "rows": rows}, announce=True)


def plot(rows: list[dict], png: Path) -> Path:
    """Draws rows' ratio-vs-size picture at `png`."""
    procs = sorted({r["procs"] for r in rows})
    runs = f"{' and '.join(map(str, procs))} processes ({png.with_suffix('.json').name})"
    return _plots.ratio_vs_size(rows, png, title=f"tpudist / torch.distributed gloo on CPU, {runs}")


if __name__ == "__main__":
    main()
