"""A DLRM-style click model trained across every process's devices: the README's main job.

    python -m tpudist.xla_dist --local --nproc-per-host 2 --cpu-devices 2 -- python examples/train_dlrm.py

Bottom MLP on dense features, several embedding tables sharded row-wise over the "model" axis (one
fused lookup for all of them), pairwise dot-product feature interaction, top MLP, binary
cross-entropy, optax Adam. The batch is split over "data" (each process generates the global batch
deterministically and keeps its own rows); the embedding rows are split over "model". Rank 0 prints
progress and, last, `loss <first> -> <last>` with examples per second. Runs on any number of
processes and devices: "model" is the per-process device count unless --model says otherwise, and
"data" takes the rest (--global-batch must divide by it). Every layout sees the same data and the
same initial tables, so 1 x 1, 2 x 2 and 4 x 2 print the same losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import tpudist


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 300  # optimizer steps
    global_batch: int = 256  # examples per step over all processes
    dense_features: int = 13  # as in the Criteo click logs
    tables: tuple[int, ...] = (1000, 800, 600, 400, 300, 200, 100, 50)  # rows of each sparse feature
    embed_dim: int = 16  # features per embedding (also the bottom MLP's output width)
    bottom: tuple[int, ...] = (64,)  # hidden widths of the bottom MLP
    top: tuple[int, ...] = (64, 32)  # hidden widths of the top MLP
    lr: float = 3e-3  # Adam learning rate
    seed: int = 0  # data and initialisation
    model: int | None = None  # size of the "model" axis; None: devices per process
    log_every: int = 50  # steps between progress lines


# -- deterministic synthetic clicks ----------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _teacher(cfg: Config) -> tuple[np.ndarray, list[np.ndarray]]:
    """The hidden rule behind the clicks: a dense weight vector and a score per table row."""
    rng = np.random.default_rng([cfg.seed, 1])
    return (rng.normal(size=cfg.dense_features) / np.sqrt(cfg.dense_features),
            [rng.normal(size=n) for n in cfg.tables])


def synthetic_batch(cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The global batch of `step`: dense (B, 13) floats, ids (B, T) with skewed popularity, labels (B,)."""
    w_dense, row_scores = _teacher(cfg)
    rng = np.random.default_rng([cfg.seed, 2, step])
    dense = rng.normal(size=(cfg.global_batch, cfg.dense_features)).astype(np.float32)
    # Squaring a uniform draw makes low ids popular, as with real categorical features.
    ids = np.stack([(n * rng.random(cfg.global_batch) ** 2).astype(np.int32) for n in cfg.tables], 1)
    logit = dense @ w_dense + sum(s[ids[:, t]] for t, s in enumerate(row_scores))
    labels = (rng.random(cfg.global_batch) < 1 / (1 + np.exp(-2 * logit))).astype(np.float32)
    return dense, ids, labels


# -- the model ---------------------------------------------------------------------------------------

def _mlp_init(rng: np.random.Generator, widths: list[int]) -> list[dict[str, np.ndarray]]:
    return [{"w": (rng.normal(size=(a, b)) * np.sqrt(2 / a)).astype(np.float32),
             "b": np.zeros(b, np.float32)} for a, b in zip(widths[:-1], widths[1:])]


def _mlp(layers: list[dict[str, jax.Array]], x: jax.Array, last_relu: bool) -> jax.Array:
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1 or last_relu:
            x = jax.nn.relu(x)
    return x


def init_params(cfg: Config, emb: tpudist.ShardedEmbedding) -> dict:
    rng = np.random.default_rng([cfg.seed, 3])
    pairs = (len(cfg.tables) + 1) * len(cfg.tables) // 2
    return {
        "bottom": _mlp_init(rng, [cfg.dense_features, *cfg.bottom, cfg.embed_dim]),
        "top": _mlp_init(rng, [cfg.embed_dim + pairs, *cfg.top, 1]),
        "tables": emb.init(jax.random.key(cfg.seed)),  # rows split over "model" from the start
    }


def forward(params: dict, emb: tpudist.ShardedEmbedding, dense: jax.Array, ids: jax.Array) -> jax.Array:
    bottom = _mlp(params["bottom"], dense, last_relu=True)  # (B, F)
    sparse = emb(params["tables"], ids)  # (B, T, F): every table in one lookup
    features = jnp.concatenate([bottom[:, None, :], sparse], axis=1)  # (B, T + 1, F)
    dots = jnp.einsum("bif,bjf->bij", features, features)
    i, j = np.triu_indices(features.shape[1], k=1)
    interactions = dots[:, i, j]  # each pair of features once
    return _mlp(params["top"], jnp.concatenate([bottom, interactions], axis=1), last_relu=False)[:, 0]


def train_step(params, opt_state, dense, ids, labels, *, emb, opt):
    def loss_fn(p):
        return optax.sigmoid_binary_cross_entropy(forward(p, emb, dense, ids), labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# -- the run ----------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        if field.name != "tables":
            kind = int if field.name == "model" else type(field.default)
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    tpudist.init()
    rank = tpudist.process_index()
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": cfg.model or jax.local_device_count()})
    if cfg.global_batch % mesh.shape["data"]:
        raise SystemExit(f"--global-batch {cfg.global_batch} does not divide over data({mesh.shape['data']}); "
                         f"use a multiple of {mesh.shape['data']}")
    emb = tpudist.ShardedEmbedding(list(cfg.tables), cfg.embed_dim, mesh=mesh, axis="model")
    params = init_params(cfg, emb)
    opt = optax.adam(cfg.lr)
    opt_state = opt.init(params)  # Adam's moments take each parameter's sharding
    step = tpudist.compile(functools.partial(train_step, emb=emb, opt=opt), mesh=mesh,
                           in_specs=(None, None, P("data"), P("data"), P("data")),
                           donate_argnums=(0, 1))
    rows = tpudist.mesh.process_slice(mesh, (cfg.global_batch,), P("data"))[0]
    if rank == 0:
        print(f"dlrm: mesh {tpudist.mesh.describe(mesh)}; {len(cfg.tables)} tables "
              f"({sum(cfg.tables)} rows x {cfg.embed_dim}) split over 'model'; global batch "
              f"{cfg.global_batch}, {rows.stop - rows.start} rows per process", flush=True)

    losses, start = [], None
    for i in range(cfg.steps):
        dense, ids, labels = synthetic_batch(cfg, i)
        params, opt_state, loss = step(params, opt_state, dense[rows], ids[rows], labels[rows])
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(loss)
            start = time.perf_counter()  # examples/s from here on: the first step compiles
        if rank == 0 and (i + 1) % cfg.log_every == 0:
            recent = float(np.mean([float(x) for x in losses[-cfg.log_every:]]))
            print(f"step {i + 1}/{cfg.steps}  loss {recent:.4f}", flush=True)
    jax.block_until_ready(losses[-1])
    seconds = time.perf_counter() - start
    rate = cfg.global_batch * (cfg.steps - 1) / seconds if cfg.steps > 1 else 0.0
    window = max(1, min(20, cfg.steps // 5))  # average the ends: one batch's loss is noisy
    first = float(np.mean([float(x) for x in losses[:window]]))
    last = float(np.mean([float(x) for x in losses[-window:]]))
    if rank == 0:
        stats = tpudist.compile_stats()
        print(f"compiled {stats.compiles}x in {stats.compile_seconds:.1f}s "
              f"({stats.cache_hits} from the persistent cache)", flush=True)
        print(f"loss {first:.4f} -> {last:.4f}  ({rate:.0f} examples/s)", flush=True)


if __name__ == "__main__":
    main()
