#!/usr/bin/env python
"""Sharded embedding vs a replicated-table data-parallel baseline, for 1, 2 and 4 processes.

    .venv/bin/python scripts/bench_embedding.py [--rows 131072] [--features 32] [--batch 2048]
                                                [--bag 4] [--steps 10] [--procs 1,2,4] [--json FILE]

One training step = bag-sum lookup of (batch, bag) ids, loss, gradient, SGD update of the table,
compiled with `tpudist.compile` over every device of N processes (1 CPU device each), same global
batch and table for every row:

- replicated: the anchor. Every device holds the whole table; the batch is split over "data";
  XLA all-reduces the full-table gradient each step (what plain data parallelism does).
- sharded/<algorithm>: `tpudist.ShardedEmbedding` with rows split over all devices ("model"),
  ids split the same way, one row per lookup algorithm (see docs/mesh_and_compile.md).

Per-device memory is XLA's own analysis of the compiled step (arguments + outputs + temporaries
- donated aliases); step time is the median of --steps blocked steps after two warm-up steps.
Prints a table, then the results as JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import tpudist
from _report import text_table  # scripts/_report.py

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
    results = []
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
        local_ids, local_w = ids[rows], weights[rows]
        memory = step.compiled(table, local_ids, local_w).memory_analysis()
        times = []
        for i in range(cfg.steps + 2):
            start = time.perf_counter()
            table, loss = step(table, local_ids, local_w)
            jax.block_until_ready(table)
            if i >= 2:
                times.append(time.perf_counter() - start)
        shard = table.addressable_shards[0].data
        seconds = statistics.median(times)
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


def _table(rows: list[dict]) -> str:
    cols = ["processes", "variant", "step_ms", "examples_per_s", "table_mib_per_device",
            "xla_mib_per_device", "temp_mib_per_device"]
    return text_table(rows, cols)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    parser.add_argument("--procs", default="1,2,4", help="comma-separated process counts")
    parser.add_argument("--json", type=Path, help="also write the results here")
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
    print(f"table {cfg.rows} x {cfg.features} float32 ({cfg.rows * cfg.features * 4 / MIB:.0f} MiB), "
          f"global batch {cfg.batch} x bag {cfg.bag}, 1 CPU device per process, median of {cfg.steps} steps")
    print(_table(rows))
    report = {"config": dataclasses.asdict(cfg), "anchor": "replicated", "results": rows}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
