#!/usr/bin/env python
"""tpudist collectives vs torch.distributed (gloo), in the same processes and the same run.

For 2 and 4 processes and sizes from 4 B to 64 MiB, times tpudist's all_reduce / all_gather /
reduce_scatter on torch tensors next to torch.distributed's gloo, and prints latency, algbw,
busbw (the nccl-tests formulas) and the ratio tpudist/gloo, as a table and as JSON.

    python scripts/bench_collectives.py [--procs 2 4] [--min-bytes 0] [--max-bytes 64Mi] [--json out.json]
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
import time

import tpudist

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _parse_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(text[:-2]) * mult
    return int(text)


def sizes(max_bytes: int, min_bytes: int = 0) -> list[int]:
    ladder = [4, 64, 1 << 10, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
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
                bare = _bare_xla(name, elems if name == "all_reduce" else elems // n, n)
                iters = _iters(elems * 4, budget)
                row = {"collective": name, "procs": n, "bytes": elems * 4, "iters": iters}
                # Interleave repetitions so all of them see the same machine load.
                runs = [("tpudist", mine), ("gloo", gloo), ("xla", bare)]
                if name == "all_reduce":
                    runs.append(("gloo_copy", lambda: dist.all_reduce(full.clone())))
                times: dict[str, list[float]] = {label: [] for label, _ in runs}
                for _ in range(2):
                    for _, fn in runs:
                        fn()
                for rep in range(3):
                    for label, fn in runs:
                        dist.barrier()
                        start = time.perf_counter()
                        for _ in range(iters):
                            fn()
                        times[label].append((time.perf_counter() - start) / iters)
                for label in times:
                    t = torch.tensor([statistics.median(times[label])], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
                    row[f"{label}_s"] = float(t)
                rows.append(row)
    finally:
        dist.destroy_process_group()
    return rows if index == 0 else []


def bus_factor(name: str, n: int) -> float:
    return 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", default="64Mi")
    parser.add_argument("--min-bytes", default="0")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per measurement (approx.)")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument("--json", default="bench-results/collectives.json")
    parser.add_argument("--plot-only", metavar="JSON", help="draw JSON's picture (JSON stem + .png) and exit")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the tpudist checked out in DIR, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            print(f"PNG: {plot(json.load(f)['rows'], args.plot_only)}")
        return
    byte_sizes = sizes(_parse_bytes(args.max_bytes), _parse_bytes(args.min_bytes))
    if args.baseline:
        return compare(args)
    rows: list[dict] = []
    for n in args.procs:
        rows += tpudist.spawn(measure, args=(byte_sizes, args.budget, tuple(args.collectives)), nprocs=n, cpu_devices=1, timeout=3600)[0]
    print(f"{'collective':15} {'procs':>5} {'size':>10} {'tpudist ms':>11} {'gloo ms':>9} {'ratio':>6} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'gloo busbw':>10} {'xla ms':>8} {'gloo+copy ms':>12}")
    for r in rows:
        r["ratio"] = r["tpudist_s"] / r["gloo_s"]
        r["algbw_GBps"] = r["bytes"] / r["tpudist_s"] / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * bus_factor(r["collective"], r["procs"])
        r["gloo_busbw_GBps"] = r["bytes"] / r["gloo_s"] / 1e9 * bus_factor(r["collective"], r["procs"])
        print(f"{r['collective']:15} {r['procs']:>5} {human(r['bytes']):>10} {r['tpudist_s'] * 1e3:>11.3f} "
              f"{r['gloo_s'] * 1e3:>9.3f} {r['ratio']:>6.2f} {r['algbw_GBps']:>10.3f} {r['busbw_GBps']:>10.3f} "
              f"{r['gloo_busbw_GBps']:>10.3f} {r['xla_s'] * 1e3:>8.3f} "
              f"{format(r['gloo_copy_s'] * 1e3, '.3f') if 'gloo_copy_s' in r else '-':>12}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    print(f"JSON: {args.json}")
    if args.no_plot:
        return
    try:
        print(f"PNG: {plot(rows, args.json)}")
    except ImportError as e:
        print(f"no PNG: {e} (pip install -e .[bench] for matplotlib)")


def compare(args: argparse.Namespace) -> None:
    """tpudist's latency in this tree and in `args.baseline`'s, alternating `args.rounds` times in one
    run; each side is this script run with that tree first on PYTHONPATH."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(tpudist.__file__)))
    trees = {"baseline": os.path.abspath(args.baseline), "this": here}
    times: dict[tuple, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for n in args.procs:
                for label, tree in trees.items():
                    out = os.path.join(tmp, f"{label}.json")
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
                    subprocess.run([sys.executable, os.path.abspath(__file__), "--procs", str(n), "--max-bytes",
                                    args.max_bytes, "--min-bytes", args.min_bytes, "--budget", str(args.budget),
                                    "--collectives", *args.collectives, "--json", out, "--no-plot"],
                                   env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
                    with open(out) as f:
                        for r in json.load(f)["rows"]:
                            t = times.setdefault((r["collective"], r["procs"], r["bytes"]), {})
                            t.setdefault(label, []).append(r["tpudist_s"])
                            t.setdefault("gloo", []).append(r["gloo_s"])
    print(f"{'collective':15} {'procs':>5} {'size':>10} {'baseline ms':>11} {'this ms':>9} {'this/baseline':>13} {'gloo ms':>8}")
    rows = []
    for (name, n, nbytes), t in sorted(times.items()):
        row = {"collective": name, "procs": n, "bytes": nbytes,
               **{f"{label}_s": statistics.median(v) for label, v in t.items()}}
        row["ratio"] = row["this_s"] / row["baseline_s"]
        rows.append(row)
        print(f"{name:15} {n:>5} {human(nbytes):>10} {row['baseline_s'] * 1e3:>11.3f} {row['this_s'] * 1e3:>9.3f} "
              f"{row['ratio']:>13.2f} {row['gloo_s'] * 1e3:>8.3f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"argv": sys.argv, "baseline": trees["baseline"], "rows": rows}, f, indent=1)
    print(f"JSON: {args.json}")


def plot(rows: list[dict], json_path: str) -> str:
    """Draws rows' ratio-vs-size picture beside `json_path` (same stem, .png); returns its path."""
    import _plots  # scripts/_plots.py, beside this script
    png = os.path.splitext(json_path)[0] + ".png"
    procs = sorted({r["procs"] for r in rows})
    _plots.ratio_vs_size(rows, png, title=f"tpudist / torch.distributed gloo on CPU, "
                                           f"{' and '.join(map(str, procs))} processes ({os.path.basename(json_path)})")
    return png


if __name__ == "__main__":
    main()
