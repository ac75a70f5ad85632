#!/usr/bin/env python
"""What tpudist.profile costs: an eager all_reduce (1 KiB, numpy) and a small compiled JAX step, on 2
processes, timed call by call with no profile, under `tpudist.profile`, and with none again; and what
one `tpudist.span` costs, off and on.

    python scripts/bench_profile.py [--calls 2000] [--steps 500] [--json bench-results/profile.json]

Prints median times per call (rank 0), off and on alternating round by round. A tpudist without `tpudist.profile` (an older checkout on
PYTHONPATH) is timed without the profiled phase, as the baseline the flag checks are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import timeit

import tpudist


def _span_costs(n: int = 100_000) -> dict[str, float]:
    """ns per call (best of 7) of a span while off or on, beside an empty function's call."""
    span = tpudist.span
    from tpudist import _profile

    def with_span():
        with span("bench.span"):
            pass

    def with_fields():
        with span("bench.span", rows=3):
            pass

    def flag():
        if _profile.active:
            pass

    def nothing():
        pass

    return {name: min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e9
            for name, fn in (("empty function", nothing), ("flag check (tpudist's call sites)", flag),
                             ("with span(name)", with_span), ("with span(name, rows=3)", with_fields))}


def job(index: int, calls: int, steps: int, rounds: int, directory: str, never: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    profiled = "profile" in dir(tpudist) and not never
    x = np.ones(256, np.float32)  # 1 KiB
    mesh = tpudist.mesh.make_mesh({"data": -1})

    def train_step(w, batch):
        h = jnp.tanh(batch @ w)
        return w - 0.01 * batch.T @ h / batch.shape[0], jnp.mean(h * h)

    step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, P("data")), donate_argnums=(0,))
    batch = np.random.default_rng(index).normal(size=(32, 64)).astype(np.float32)
    state = {"w": np.eye(64, dtype=np.float32)}

    def one_step():
        state["w"], loss = step(state["w"], batch)
        jax.block_until_ready(loss)

    def timed(fn, n: int) -> list[float]:
        tpudist.barrier()
        out = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    for _ in range(50):
        tpudist.all_reduce(x)
        one_step()
    # Off and on alternate, round after round, so that both see the same machine load.
    samples = {mode: {"all_reduce": [], "step": []} for mode in ("off", "on")}
    spans: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for mode in ("off", "on") if profiled else ("off",):
            if mode == "on":
                tpudist.start_profile(directory)
            samples[mode]["all_reduce"] += timed(lambda: tpudist.all_reduce(x), calls // rounds)
            samples[mode]["step"] += timed(one_step, steps // rounds)
            if mode == "on":
                tpudist.stop_profile()
    if profiled:
        spans["off"] = _span_costs()
        with tpudist.profile(directory):
            spans["on"] = _span_costs()
    return {"rank": index, "profiled": profiled,
            "median_us": {mode: {k: statistics.median(v) * 1e6 for k, v in s.items()}
                          for mode, s in samples.items() if s["step"]},
            "span_ns": spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="all_reduce calls per phase")
    parser.add_argument("--steps", type=int, default=500, help="compiled steps per phase")
    parser.add_argument("--rounds", type=int, default=5, help="off/on alternations")
    parser.add_argument("--never", action="store_true", help="only the unprofiled phase (a baseline)")
    parser.add_argument("--json", default="bench-results/profile.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = tpudist.spawn(job, args=(args.calls, args.steps, args.rounds, directory, args.never), nprocs=2,
                                cpu_devices=1, timeout=1800)
    first = results[0]
    print(f"{'profile':8} {'all_reduce 1 KiB (us)':>22} {'compiled step (us)':>19}")
    for mode, m in first["median_us"].items():
        print(f"{mode:8} {m['all_reduce']:>22.1f} {m['step']:>19.1f}")
    for mode, costs in first["span_ns"].items():
        for name, ns in costs.items():
            print(f"profile {mode}: {name}: {ns:.0f} ns")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"argv": sys.argv, "ranks": results}, f, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
