"""What an all-reduce over ONE device costs on XLA:CPU: a train step (tanh MLP, SGD, parameters
donated) under `shard_map` on a 1-device mesh, with the gradients averaged by `lax.pmean` (what a
data-parallel step does) against the same step without it (what tpudist's fused step does on one
device, see tpudist/compile/_torch/_body.py). Side by side in one run; best of the repeats.

    python scripts/bench_one_device_allreduce.py [--json F] [--repeats 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from _report import text_table

SHAPES = [(8, 64), (8, 256), (8, 512), (8, 1024), (24, 1024)]  # (layers, width)


def _loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return x.sum()


def _step(averaged: bool, mesh: Mesh):
    def body(params, x):
        if averaged:
            own = [lax.pcast(p, "data", to="varying") for p in params]
            loss, grads = jax.value_and_grad(_loss)(own, x)
            grads, loss = lax.pmean(grads, "data"), lax.pmean(loss, "data")
        else:
            loss, grads = jax.value_and_grad(_loss)(params, x)
        return [p - 0.01 * g for p, g in zip(params, grads)], loss
    batch = P("data") if averaged else P()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), batch), out_specs=(P(), P())), donate_argnums=0)


def _time(step, layers: int, width: int, steps: int, repeats: int) -> float:
    params = [jnp.full((width, width), 0.01, jnp.float32) for _ in range(layers)]
    x = jnp.ones((4, width), jnp.float32)
    params, loss = step(params, x)
    jax.block_until_ready(loss)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            params, loss = step(params, x)
        jax.block_until_ready(loss)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    plain, averaged = _step(False, mesh), _step(True, mesh)
    rows = []
    for layers, width in SHAPES:
        without = _time(plain, layers, width, args.steps, args.repeats)
        with_ = _time(averaged, layers, width, args.steps, args.repeats)
        rows.append({"layers": layers, "width": width, "MiB": f"{layers * width * width * 4 / 2**20:.1f}",
                     "no all-reduce ms": f"{without * 1e3:.3f}", "all-reduce ms": f"{with_ * 1e3:.3f}",
                     "ratio": f"{with_ / without:.2f}x", "seconds": {"without": without, "with": with_}})
    print(f"one-device all-reduce on {jax.devices()[0].platform}, best of {args.repeats} x {args.steps} steps")
    print(text_table(rows, ["layers", "width", "MiB", "no all-reduce ms", "all-reduce ms", "ratio"]))
    if args.json:
        args.json.write_text(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
