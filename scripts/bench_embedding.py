#!/usr/bin/env python
"""Sharded embedding vs a replicated-table data-parallel baseline, for 1, 2 and 4 processes.

    .venv/bin/python scripts/bench_embedding.py [--rows 131072] [--features 32] [--batch 2048]
                                                [--bag 4] [--steps 10] [--procs 1,2,4] [--json FILE] [--no-plot]

One training step = bag-sum lookup of (batch, bag) ids, loss, gradient, SGD update of the table,
compiled with `tpudist.compile` over every device of N processes (1 CPU device each), same global
batch and table for every row:

- replicated: the anchor. Every device holds the whole table; the batch is split over "data";
  XLA all-reduces the full-table gradient each step (what plain data parallelism does).
- sharded/<algorithm>: `tpudist.ShardedEmbedding` with rows split over all devices ("model"),
  ids split the same way, one row per lookup algorithm (see docs/mesh_and_compile.md).

Per-device memory is XLA's own analysis of the compiled step (arguments + outputs + temporaries
- donated aliases); step time is the median of --steps blocked steps after two warm-up steps, the
variants taking turns step by step (scripts/_bench.py). Prints a table, writes the JSON
(bench-results/embedding.json by default) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

import _bench
import _plots
import tpudist

VARIANTS = ("replicated", "sharded/psum", "sharded/psum_scatter", "sharded/all_to_all")
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int = 131072
    features: int = 32
    batch: int = 2048
    bag: int = 4
    steps: int = 10
    lr: float = 0.1


def _job(index: int, cfg: Config) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(0)
    ids = (cfg.rows * rng.random((cfg.batch, cfg.bag)) ** 2).astype(np.int32)  # skewed popularity
    weights = rng.normal(size=(cfg.batch, cfg.features)).astype(np.float32)
    sides, about = {}, {}
    for variant in VARIANTS:
        if variant == "replicated":
            mesh = tpudist.mesh.make_mesh({"data": -1})
            batch_spec = P("data")
            table = jax.device_put(jnp.zeros((cfg.rows, cfg.features), jnp.float32) + 0.01,
                                   NamedSharding(mesh, P()))

            def lookup(t, i):
                return jnp.take(t, i, axis=0).sum(axis=1)
        else:
            mesh = tpudist.mesh.make_mesh({"data": 1, "model": -1})
            batch_spec = P(("data", "model"))
            emb = tpudist.ShardedEmbedding(cfg.rows, cfg.features, mesh=mesh, axis="model",
                                           combiner="sum", algorithm=variant.split("/")[1])
            table = emb.init(jax.random.key(0))
            lookup = emb

        def train(t, i, w, lookup=lookup):
            loss, grad = jax.value_and_grad(lambda t: jnp.sum(lookup(t, i) * w))(t)
            return t - cfg.lr * grad, loss

        step = tpudist.compile(train, mesh=mesh, in_specs=(None, batch_spec, batch_spec),
                               donate_argnums=0, name=variant)
        rows = tpudist.mesh.process_slice(mesh, (cfg.batch,), batch_spec)[0]
        local = (ids[rows], weights[rows])
        state = {"table": table}

        def one_step(step=step, local=local, state=state):
            state["table"], _ = step(state["table"], *local)
            return state["table"]

        memory = step.compiled(table, *local).memory_analysis()
        sides[variant] = _bench.Side(one_step, wait=jax.block_until_ready)
        about[variant] = (state, memory)
    # One blocked step of each variant per round, the anchor among them, two warm-up steps each.
    times = _bench.interleave(sides, rounds=cfg.steps, warmup=2)
    results = []
    for variant, (state, memory) in about.items():
        shard = state["table"].addressable_shards[0].data
        seconds = times[variant].median
        total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                 + memory.temp_size_in_bytes - memory.alias_size_in_bytes) if memory else None
        results.append({
            "processes": jax.process_count(), "variant": variant,
            "step_ms": round(seconds * 1e3, 2),
            "examples_per_s": round(cfg.batch / seconds),
            "table_mib_per_device": round(shard.nbytes / MIB, 2),
            "xla_mib_per_device": None if total is None else round(total / MIB, 2),
            "temp_mib_per_device": None if memory is None else round(memory.temp_size_in_bytes / MIB, 2),
        })
    return results


COLUMNS = [("processes", "processes"), ("variant", "variant", "s")] + [
    (c, c) for c in ("step_ms", "examples_per_s", "table_mib_per_device", "xla_mib_per_device", "temp_mib_per_device")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    parser.add_argument("--procs", default="1,2,4", help="comma-separated process counts")
    _bench.add_output_args(parser, "embedding")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process count")
    args = parser.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    rows: list[dict] = []
    for nprocs in (int(p) for p in args.procs.split(",")):
        per_rank = tpudist.spawn(_job, args=(cfg,), nprocs=nprocs, cpu_devices=1, timeout=args.timeout)
        # The slowest rank sets the step time; memory is the same on every rank.
        for variant_rows in zip(*per_rank):
            slowest = max(variant_rows, key=lambda r: r["step_ms"])
            rows.append({**slowest, "examples_per_s": min(r["examples_per_s"] for r in variant_rows)})
        print(f"[{nprocs} process(es) done]", file=sys.stderr, flush=True)
    print(_bench.table(rows, COLUMNS, f"table {cfg.rows} x {cfg.features} float32 "
                       f"({cfg.rows * cfg.features * 4 / MIB:.0f} MiB), global batch {cfg.batch} x bag {cfg.bag}, "
                       f"1 CPU device per process, median of {cfg.steps} steps"))
    out = _bench.Output.from_args(args)
    out.write({"config": dataclasses.asdict(cfg), "anchor": "replicated", "results": rows}, announce=True)
    out.picture(lambda png: _plots.time_bars(rows, png, keys=["step_ms"], labels=["step (ms)"],
                                             group=["variant", "processes"], ylabel="ms per step",
                                             title="sharded embedding vs a replicated table"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
