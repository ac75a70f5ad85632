#!/usr/bin/env python
"""What tpudist.profile costs: an eager all_reduce (1 KiB, numpy) and a small compiled JAX step, on 2
processes, timed call by call with no profile, under `tpudist.profile`, and with none again; and what
one `tpudist.span` costs, off and on.

    python scripts/bench_profile.py [--calls 2000] [--steps 500] [--json bench-results/profile.json] [--no-plot]

Prints median times per call (rank 0), off and on alternating round by round (scripts/_bench.py).
A tpudist without `tpudist.profile` (an older checkout on PYTHONPATH) is timed without the profiled
phase, as the baseline the flag checks are compared with.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import _bench
import _plots
import tpudist


def _span_costs(n: int = 100_000) -> dict[str, float]:
    """ns per call (median of 7 interleaved runs of n) of a span while off or on, beside an empty
    function's call (the anchor)."""
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

    times = _bench.interleave({"empty function": nothing, "flag check (tpudist's call sites)": flag,
                               "with span(name)": with_span, "with span(name, rows=3)": with_fields},
                              rounds=7, steps=n)
    return {name: t.median * 1e9 for name, t in times.items()}


@contextlib.contextmanager
def _profiled(directory: str):
    tpudist.start_profile(directory)
    try:
        yield
    finally:
        tpudist.stop_profile()


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

    def all_reduce():
        tpudist.all_reduce(x)

    # Off and on alternate, round after round, so that both see the same machine load; every call
    # is timed alone, each run starting at a barrier.
    sides = {}
    for mode in ("off", "on") if profiled else ("off",):
        around = (lambda: _profiled(directory)) if mode == "on" else contextlib.nullcontext
        sides[f"{mode}/all_reduce"] = _bench.Side(all_reduce, around=around, steps=calls // rounds)
        sides[f"{mode}/step"] = _bench.Side(one_step, around=around, steps=steps // rounds)
    times = _bench.interleave(sides, rounds=rounds, warmup=25, per_call=True, before_run=tpudist.barrier)
    spans: dict[str, dict[str, float]] = {}
    if profiled:
        spans["off"] = _span_costs()
        with tpudist.profile(directory):
            spans["on"] = _span_costs()
    median_us: dict[str, dict[str, float]] = {}
    for side, timing in times.items():
        mode, what = side.split("/")
        median_us.setdefault(mode, {})[what] = timing.median * 1e6
    return {"rank": index, "profiled": profiled, "median_us": median_us, "span_ns": spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="all_reduce calls per phase")
    parser.add_argument("--steps", type=int, default=500, help="compiled steps per phase")
    parser.add_argument("--rounds", type=int, default=5, help="off/on alternations")
    parser.add_argument("--never", action="store_true", help="only the unprofiled phase (a baseline)")
    _bench.add_output_args(parser, "profile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = tpudist.spawn(job, args=(args.calls, args.steps, args.rounds, directory, args.never), nprocs=2,
                                cpu_devices=1, timeout=1800)
    first = results[0]
    modes = [{"profile": mode, **m} for mode, m in first["median_us"].items()]
    print(_bench.table(modes, [("profile", "profile", "s"), ("all_reduce 1 KiB (us)", "all_reduce", ".1f"),
                               ("compiled step (us)", "step", ".1f")], "median per call, rank 0"))
    spans = [{"profile": mode, "call": name, "ns": ns} for mode, costs in first["span_ns"].items()
             for name, ns in costs.items()]
    if spans:
        print(_bench.table(spans, [("profile", "profile", "s"), ("call", "call", "s"), ("ns", "ns", ".0f")]))
    out = _bench.Output.from_args(args)
    out.write({"ranks": results}, announce=True)
    out.picture(lambda png: _plots.time_bars(modes, png, keys=["all_reduce", "step"],
                                             labels=["all_reduce 1 KiB", "compiled step"], group="profile",
                                             ylabel="us per call (median)", title="tpudist.profile off and on"))


if __name__ == "__main__":
    main()
