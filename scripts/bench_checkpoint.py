#!/usr/bin/env python
"""Save and restore time and bytes per process for a ShardedEmbedding checkpoint.

    .venv/bin/python scripts/bench_checkpoint.py [--rows 1000000] [--features 64] [--procs 2]
                                                 [--cpu-devices 1] [--repeats 3] [--dir DIR]
                                                 [--json bench-results/checkpoint.json]

N processes (one CPU device each by default) hold a `tpudist.ShardedEmbedding(rows, features)`
float32 table with its rows split over every device ("model" spans the processes), and each round:

- save: `tpudist.checkpoint.save(dir, step, {"table": table})`, waited for (written and committed);
- restore: `tpudist.checkpoint.restore(dir, like=...)` into the table's sharding, from
  `jax.ShapeDtypeStruct`s (no memory held for the target), until the arrays are ready;
- async save: `save(..., wait=False)`, timing what blocks the caller and then the wait for the commit.

Each phase starts at a barrier; a process's time is its own (the slowest sets the job's). Bytes
per process are its shard of the table and what it wrote (its `ocdbt.process_<i>` store, on disk).
Prints a table (medians over the rounds, scripts/_bench.py), writes the JSON (--json) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import _bench
import _plots
import tpudist

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int = 1_000_000
    features: int = 64
    repeats: int = 3


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _job(index: int, cfg: Config, directory: str) -> dict:
    import jax

    mesh = tpudist.mesh.make_mesh({"model": -1})
    emb = tpudist.ShardedEmbedding(cfg.rows, cfg.features, mesh=mesh, axis="model")
    table = jax.block_until_ready(emb.init(jax.random.key(0)))
    like = {"table": jax.ShapeDtypeStruct(table.shape, table.dtype, sharding=table.sharding)}
    mine = {s.device: np.asarray(s.data) for s in table.addressable_shards}
    steps = iter(range(1, 2 * cfg.repeats + 1))
    saved = []

    def save() -> dict:
        step = next(steps)
        start = time.perf_counter()
        tpudist.checkpoint.save(directory, step, {"table": table}, keep=2)
        seconds = time.perf_counter() - start
        saved.append(step)
        written = _bytes_under(os.path.join(directory, str(step), "default", f"ocdbt.process_{index}"))
        return {"save_s": seconds, "written": written}

    def restore() -> dict:
        start = time.perf_counter()
        _, restored = tpudist.checkpoint.restore(directory, like=like, step=saved[-1])
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - start
        for shard in restored["table"].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), mine[shard.device]), "restored values differ"
        return {"restore_s": seconds}

    def save_async() -> dict:
        start = time.perf_counter()
        handle = tpudist.checkpoint.save(directory, next(steps), {"table": table}, wait=False, keep=2)
        blocked = time.perf_counter() - start
        handle.wait()
        return {"async_block_s": blocked, "async_total_s": time.perf_counter() - start}

    # Each phase starts at a barrier; the restore reads the round's own save.
    runs = _bench.alternate({"save": save, "restore": restore, "async": save_async}, cfg.repeats,
                            before=tpudist.barrier)
    times = {k: statistics.median(r[k] for r in rs) for rs in runs.values() for k in rs[0]}
    shard_bytes = sum(s.data.nbytes for s in table.addressable_shards if s.replica_id == 0)
    return {"process": index, "devices": len(jax.local_devices()),
            "shard_mib": round(shard_bytes / MIB, 1), "written_mib": round(times.pop("written") / MIB, 1),
            **{k: round(v, 3) for k, v in times.items()},
            "save_mib_per_s": round(shard_bytes / MIB / times["save_s"], 1),
            "restore_mib_per_s": round(shard_bytes / MIB / times["restore_s"], 1)}


COLUMNS = [(c, c) for c in ("process", "shard_mib", "written_mib", "save_s", "restore_s", "async_block_s",
                            "async_total_s", "save_mib_per_s", "restore_mib_per_s")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument("--dir", help="checkpoint directory (default: a fresh temporary one, removed after)")
    _bench.add_output_args(parser, "checkpoint")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    with tempfile.TemporaryDirectory(prefix="tpudist-bench-ckpt-") as scratch:
        directory = args.dir or os.path.join(scratch, "ckpt")
        rows = tpudist.spawn(_job, args=(cfg, directory), nprocs=args.procs, cpu_devices=args.cpu_devices,
                             timeout=args.timeout)
    load = os.getloadavg()[0]
    print(_bench.table(rows, COLUMNS, f"ShardedEmbedding {cfg.rows} x {cfg.features} float32 "
                       f"({cfg.rows * cfg.features * 4 / MIB:.0f} MiB), rows over {args.procs} processes x "
                       f"{args.cpu_devices} CPU device(s); median of {cfg.repeats} rounds; "
                       f"load average {load:.1f} on {os.cpu_count()} CPUs"))
    out = _bench.Output.from_args(args)
    out.write({"config": {**dataclasses.asdict(cfg), "procs": args.procs, "cpu_devices": args.cpu_devices},
               "load_average": load, "results": rows}, announce=True)
    out.picture(lambda png: _plots.time_bars(
        rows, png, keys=["save_s", "restore_s", "async_block_s", "async_total_s"],
        labels=["save", "restore", "async save: blocked", "async save: committed"],
        group=lambda r: f"process {r['process']}", ylabel="seconds", title="checkpoint save and restore"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
