"""What an all-reduce over ONE device costs on XLA:CPU: a train step (tanh MLP, SGD, parameters
donated) under `shard_map` on a 1-device mesh, with the gradients averaged by `lax.pmean` (what a
data-parallel step does) against the same step without it (what tpudist's fused step does on one
device, see tpudist/compile/_torch/train/_body.py). Side by side in one run, interleaved; median
of the repeats.

    python scripts/bench_one_device_allreduce.py [--json F] [--no-plot] [--repeats 5] [--steps 20]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import _bench
import _plots

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


def _side(step, layers: int, width: int) -> _bench.Side:
    """One step of `step` on its own parameters (donated: each step takes the last one's)."""
    held = {"params": [jnp.full((width, width), 0.01, jnp.float32) for _ in range(layers)]}
    x = jnp.ones((4, width), jnp.float32)

    def one() -> jax.Array:
        held["params"], loss = step(held["params"], x)
        return loss
    return _bench.Side(one, wait=jax.block_until_ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _bench.add_output_args(parser, "one_device_allreduce")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    plain, averaged = _step(False, mesh), _step(True, mesh)
    rows = []
    for layers, width in SHAPES:
        times = _bench.interleave({"without": _side(plain, layers, width), "with": _side(averaged, layers, width)},
                                  rounds=args.repeats, steps=args.steps, warmup=1)
        without, with_ = times["without"].median, times["with"].median
        rows.append({"layers": layers, "width": width, "MiB": f"{layers * width * width * 4 / 2**20:.1f}",
                     "no all-reduce ms": f"{without * 1e3:.3f}", "all-reduce ms": f"{with_ * 1e3:.3f}",
                     "ratio": f"{with_ / without:.2f}x", "seconds": {"without": without, "with": with_}})
    print(_bench.table(rows, [(c, c) for c in ("layers", "width", "MiB", "no all-reduce ms", "all-reduce ms", "ratio")],
                       f"one-device all-reduce on {jax.devices()[0].platform}, median of {args.repeats} x "
                       f"{args.steps} steps"))
    out = _bench.Output.from_args(args)
    out.write({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, announce=True)
    bars = [{"shape": f"{r['layers']} x {r['width']}", "without_ms": r["seconds"]["without"] * 1e3,
             "with_ms": r["seconds"]["with"] * 1e3} for r in rows]
    out.picture(lambda png: _plots.time_bars(bars, png, keys=["without_ms", "with_ms"],
                                             labels=["no all-reduce", "all-reduce over 1 device"], group="shape",
                                             title="one-device all-reduce on XLA:CPU (layers x width)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
