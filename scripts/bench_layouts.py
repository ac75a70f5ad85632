"""Expert, context and pipeline parallelism in the fused step, each against the same model and
layout written by hand in JAX on the same mesh.

    python scripts/bench_layouts.py                          # all three layouts, 4 CPU devices
    python scripts/bench_layouts.py --layouts experts --experts 8 --tokens 1024 --rounds 5

One process with 4 XLA CPU devices (TPUDIST_CPU_DEVICES); AdamW on both sides; the JAX side's
parameters and moments laid out by the `PartitionSpec`s `step.shardings()` reports, its batch
placed as tpudist places it. Both first-step losses (same weights, same batch) must agree.

- experts (mesh fsdp 2 x expert 2): `transformers`' `MixtralSparseMoeBlock` (router, top-k,
  stacked experts) on a mean-squared error, `Sharding(fsdp=True, tp="experts")`; by hand: the
  router, softmax and top-k, then a `shard_map` over the expert axis that sends each device's
  (token, expert) pairs to the experts' devices with `all_to_all`, runs them with `ragged_dot` and
  sends them back.
- context (mesh context 4): a decoder as a torch user writes one (embedding, blocks of
  `F.scaled_dot_product_attention(is_causal=True)` and a GELU MLP, a head; next-token cross
  entropy), its sequence split over "context"; by hand: the same decoder with its batch split over
  the sequence and attention in a `shard_map` that all-gathers keys and values.
- pipeline (mesh stage 4): the same decoder with --pipeline-layers blocks, split into 4 stages of
  consecutive blocks, `accumulate_steps=--microbatches` (M) micro-batches in a GPipe schedule; by
  hand: the blocks' parameters stacked (L, ...) and split over "stage", the embedding per
  micro-batch, then a `shard_map` over "stage" scanning the M + 3 ticks (each stage scans its
  blocks on micro-batch t - s and `ppermute`s the result on; the last stage keeps it), then the
  head and loss per micro-batch. The bubble: both sides timed again at 2M micro-batches of the same
  size (one more tick each), so a tick costs c = (T(2M) - T(M)) / M and the 3 idle ticks take
  3c / T(M) of the step ("bubble", against the ticks' share 3 / (M + 3) in brackets).

Target: tpudist / jax within 1.15x for each.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import _bench

DEVICES = 4
LR, WEIGHT_DECAY = 3e-3, 0.1


def moe_block(args: argparse.Namespace) -> Any:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    torch.manual_seed(args.seed)
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    layer = MixtralSparseMoeBlock(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer


def moe_jax(args: argparse.Namespace, mesh: Any) -> Any:
    """The layer's loss by hand: (params, x, target) -> mean squared error."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    devices, k = mesh.shape["expert"], args.top_k
    local = args.experts // devices

    def experts(x, index, weights, gate_up, down):  # one device's tokens; its experts
        tokens, width = x.shape
        pairs = tokens * k
        expert = index.reshape(pairs)
        dest = expert // local
        order = jnp.argsort(expert, stable=True)  # by device, then expert (each device's experts contiguous)
        dest_sorted = dest[order]
        counts = jnp.zeros(devices, jnp.int32).at[dest].add(1)
        slot = jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[dest_sorted]
        send = jnp.zeros((devices, pairs, width), x.dtype).at[dest_sorted, slot].set(x[order // k])
        ids = jnp.full((devices, pairs), local, jnp.int32).at[dest_sorted, slot].set(expert[order] % local)
        rows = lax.all_to_all(send, "expert", 0, 0).reshape(-1, width)
        ids = lax.all_to_all(ids, "expert", 0, 0).reshape(-1)
        by = jnp.argsort(ids, stable=True)
        sizes = jnp.zeros(local + 1, jnp.int32).at[ids].add(1)[:local]
        h = lax.ragged_dot(rows[by], gate_up.transpose(0, 2, 1), sizes)
        gate, up = jnp.split(h, 2, axis=-1)
        y = lax.ragged_dot(jax.nn.silu(gate) * up, down.transpose(0, 2, 1), sizes)
        back = lax.all_to_all(jnp.zeros_like(rows).at[by].set(y).reshape(devices, pairs, width), "expert", 0, 0)
        out = back[dest_sorted, slot] * weights.reshape(pairs)[order][:, None]
        return jnp.zeros((tokens, width), out.dtype).at[order // k].add(out)

    tokens = P(("fsdp", "expert"))
    sharded = jax.shard_map(experts, mesh=mesh, in_specs=(tokens, tokens, tokens, P("expert"), P("expert")),
                            out_specs=tokens, axis_names={"fsdp", "expert"}, check_vma=False)

    def loss(p, x, target):
        flat = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(flat @ p["gate.weight"].T, axis=-1)
        top, index = lax.top_k(probs, k)
        out = sharded(flat, index, top / top.sum(-1, keepdims=True), p["experts.gate_up_proj"],
                      p["experts.down_proj"])
        return jnp.mean((out.reshape(x.shape) - target) ** 2)
    return loss


def decoder(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.ModuleDict):  # a module of its own: what a "stage" axis finds the layers by
        def forward(self, x):
            q, k, v = self["qkv"](x).unflatten(-1, (3, args.heads, -1)).permute(2, 0, 3, 1, 4)
            x = x + self["out"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
            return x + self["down"](F.gelu(self["up"](self["norm"](x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(args.seed)
            width = args.width
            self.embed = torch.nn.Embedding(args.vocab, width)
            self.blocks = torch.nn.ModuleList(Block({
                "qkv": torch.nn.Linear(width, 3 * width), "out": torch.nn.Linear(width, width),
                "norm": torch.nn.LayerNorm(width), "up": torch.nn.Linear(width, 4 * width),
                "down": torch.nn.Linear(4 * width, width)}) for _ in range(args.layers))
            self.head = torch.nn.Linear(width, args.vocab)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    return Model()


def decoder_loss(logits: Any, ids: Any) -> Any:
    import torch.nn.functional as F
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def decoder_jax(args: argparse.Namespace, mesh: Any) -> Any:
    """The decoder's loss by hand: (params, ids, ids) -> next-token cross entropy."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    split = P(None, None, "context", None)
    rows = args.seq // mesh.shape["context"]

    def attend(q, k, v):  # one device's queries; every key, gathered
        k, v = (lax.all_gather(t, "context", axis=2, tiled=True) for t in (k, v))
        first = lax.axis_index("context") * rows
        keep = (first + jnp.arange(rows))[:, None] >= jnp.arange(args.seq)[None, :]
        scores = jnp.where(keep, q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1]), -jnp.inf)
        return jax.nn.softmax(scores, axis=-1) @ v
    attention = jax.shard_map(attend, mesh=mesh, in_specs=(split, split, split), out_specs=split,
                              axis_names={"context"}, check_vma=False)
    linear = lambda p, name, x: x @ p[f"{name}.weight"].T + p[f"{name}.bias"]  # noqa: E731
    tokens = NamedSharding(mesh, P(None, "context"))

    def loss(p, ids, _):
        x = lax.with_sharding_constraint(p["embed.weight"][ids], NamedSharding(mesh, P(None, "context", None)))
        for i in range(args.layers):
            b = f"blocks.{i}"
            qkv = linear(p, f"{b}.qkv", x).reshape(*x.shape[:2], 3, args.heads, -1).transpose(2, 0, 3, 1, 4)
            attended = attention(*qkv).transpose(0, 2, 1, 3).reshape(x.shape)
            x = x + linear(p, f"{b}.out", attended)
            mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
            normed = (x - mean) / jnp.sqrt(var + 1e-5) * p[f"{b}.norm.weight"] + p[f"{b}.norm.bias"]
            x = x + linear(p, f"{b}.down", jax.nn.gelu(linear(p, f"{b}.up", normed), approximate=False))
        logits = linear(p, "head", x)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, lax.with_sharding_constraint(ids, tokens)[:, 1:, None], -1))
    return loss


def pipeline_jax(args: argparse.Namespace, mesh: Any, microbatches: int) -> Any:
    """The decoder's loss by hand, its blocks pipelined over "stage" (GPipe): (params, ids, ids) ->
    the mean of the micro-batches' next-token cross entropies."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    stages = mesh.shape["stage"]
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    linear = lambda w, name, x: x @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # noqa: E731
    keep = jnp.tril(jnp.ones((args.pipeline_seq, args.pipeline_seq), bool))

    def block(x, w):  # one block on one micro-batch; w: its rows of the stacked parameters
        q, k, v = linear(w, "qkv", x).reshape(*x.shape[:2], 3, args.heads, -1).transpose(2, 0, 3, 1, 4)
        scores = jnp.where(keep, q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1]), -jnp.inf)
        x = x + linear(w, "out", (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(x.shape))
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        normed = (x - mean) / jnp.sqrt(var + 1e-5) * w["norm.weight"] + w["norm.bias"]
        return x + linear(w, "down", jax.nn.gelu(linear(w, "up", normed), approximate=False)), None

    def local(xs, weights):  # every micro-batch's embeddings; this stage's blocks
        s = lax.axis_index("stage")

        def tick(state, t):
            carry, kept = state
            x = jnp.where(s == 0, xs[jnp.clip(t, 0, microbatches - 1)], carry)
            y, _ = lax.scan(block, x, weights)
            slot = jnp.clip(t - (stages - 1), 0, microbatches - 1)
            kept = kept.at[slot].set(jnp.where((s == stages - 1) & (t >= stages - 1), y, kept[slot]))
            return (lax.ppermute(y, "stage", ring), kept), None
        (_, kept), _ = lax.scan(tick, (jnp.zeros_like(xs[0]), jnp.zeros_like(xs)),
                                jnp.arange(microbatches + stages - 1))
        return kept[None]
    staged = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("stage")), out_specs=P("stage"),
                           axis_names={"stage"}, check_vma=False)

    def head_loss(p, x, ids):
        logp = jax.nn.log_softmax(linear(p, "head", x)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    def loss(p, ids, _):
        micro = ids.reshape(microbatches, -1, ids.shape[-1])
        xs = jax.vmap(lambda i: p["embed.weight"][i])(micro)
        weights = {n.removeprefix("blocks.*."): v for n, v in p.items() if n.startswith("blocks.*.")}
        out = staged(xs, weights)[stages - 1]
        return jnp.mean(jax.vmap(lambda x, i: head_loss(p, x, i))(out, micro))
    return loss


def _arrays(model: Any, specs: dict[str, Any]) -> dict[str, Any]:
    """`model`'s parameters by the names `specs` holds: a stacked name ("blocks.*.qkv.weight") is
    its layers' parameters, stacked in layer order."""
    import re

    import numpy as np
    own = {n: p.detach().numpy() for n, p in model.named_parameters()}
    out = {}
    for name in specs:
        if "*" not in name:
            out[name] = own[name]
            continue
        pattern = re.compile(re.escape(name).replace(r"\*", r"(\d+)"))
        layers = sorted((int(m.group(1)), v) for n, v in own.items() if (m := pattern.fullmatch(n)))
        out[name] = np.stack([v for _, v in layers])
    return out


def _pair(name: str, mesh: Any, make: Any, loss_fn: Any, sharding: Any, loss: Any, batch: tuple, batch_spec: Any,
          accumulate: int = 1) -> tuple:
    """tpudist's step and the step by hand in JAX (`loss`) on the same weights and batch, the JAX
    side's parameters laid out as `step.shardings()` reports: (step, model, specs, JAX step, first
    losses); SystemExit where the first losses differ."""
    import jax
    import optax
    import torch
    from jax.sharding import NamedSharding
    import tpudist

    model = make()
    step = tpudist.compile_train_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=LR,
                                      weight_decay=WEIGHT_DECAY), mesh=mesh, sharding=sharding,
                                      accumulate_steps=accumulate)
    fresh = make()  # the same weights, before tpudist's first step
    first = float(step(batch))
    specs = step.shardings()  # after the first step, which names a pipeline's stacked parameters
    params = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in _arrays(fresh, specs).items()}
    opt = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)

    @jax.jit
    def train(p, s, a, b):
        value, grads = jax.value_and_grad(loss)(p, a, b)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value
    placed = [jax.device_put(t.numpy(), NamedSharding(mesh, batch_spec)) for t in batch]
    held = [params, opt.init(params)]

    def jax_side():
        held[0], held[1], value = train(held[0], held[1], *placed)
        return value
    losses = {"tpudist": first, "jax": float(jax_side())}
    if abs(losses["jax"] - losses["tpudist"]) > 1e-4 * abs(losses["tpudist"]):
        raise SystemExit(f"{name}: first-step losses differ ({accumulate} micro-batches): {losses} (same weights, "
                         "same batch): not the same model")
    return step, model, specs, jax_side, losses


def _bubble(times: dict[str, Any], microbatches: int, stages: int) -> dict[str, float]:
    """The bubble's share of the step, per side, from its times at M and 2M micro-batches (each one
    more tick of c = (T(2M) - T(M)) / M: the S - 1 idle ticks take (S - 1) c / T(M)), and the ticks'."""
    out = {"bubble_ticks": (stages - 1) / (microbatches + stages - 1)}
    for side in ("tpudist", "jax"):
        one, two = times[side].median, times[f"{side} 2M"].median
        out[f"{side}_2m_ms"] = two * 1e3
        out[f"bubble_{side}"] = (stages - 1) * (two - one) / microbatches / one
    return out


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import torch
    from jax.sharding import PartitionSpec as P
    import tpudist

    g = torch.Generator().manual_seed(args.seed + 1)
    micro = 1
    if name == "experts":
        axes, make, loss_fn = {"fsdp": 2, "expert": 2}, lambda: moe_block(args), torch.nn.functional.mse_loss
        sharding, by_hand = tpudist.Sharding(fsdp=True, tp="experts"), moe_jax
        x = torch.randn(4, args.tokens // 4, args.hidden, generator=g)
        batch = (x, torch.randn(x.shape, generator=g))
        batch_spec = P("fsdp")
    elif name == "context":
        axes, make, loss_fn = {"context": DEVICES}, lambda: decoder(args), decoder_loss
        sharding, by_hand = tpudist.Sharding(), decoder_jax
        ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g)
        batch, batch_spec = (ids, ids), P()
    else:
        model_args = argparse.Namespace(**{**vars(args), "layers": args.pipeline_layers})
        axes, make, loss_fn = {"stage": DEVICES}, lambda: decoder(model_args), decoder_loss
        sharding, micro = tpudist.Sharding(), args.microbatches
        by_hand = lambda _, mesh: pipeline_jax(model_args, mesh, micro)  # noqa: E731
        ids = torch.randint(0, args.vocab, (2 * args.pipeline_rows, args.pipeline_seq), generator=g)
        batch, batch_spec = (ids[:args.pipeline_rows],) * 2, P()
    mesh = tpudist.mesh.make_mesh(axes)
    step, model, specs, jax_side, losses = _pair(name, mesh, make, loss_fn, sharding, by_hand(args, mesh), batch,
                                                 batch_spec, micro)
    sides = {"tpudist": _bench.Side(lambda: step(batch), float), "jax": _bench.Side(jax_side, jax.block_until_ready)}
    steps, extra = [step], {}
    if name == "pipeline":  # again at 2M micro-batches of the same size: M more ticks
        double = (ids, ids)
        step2, _, _, jax2, extra["first_loss_2m"] = _pair(name, mesh, make, loss_fn, sharding,
                                                           pipeline_jax(model_args, mesh, 2 * micro), double,
                                                           batch_spec, 2 * micro)
        sides.update({"tpudist 2M": _bench.Side(lambda: step2(double), float),
                      "jax 2M": _bench.Side(jax2, jax.block_until_ready)})
        steps.append(step2)
    times = _bench.interleave(sides, rounds=args.rounds, steps=args.steps, warmup=2, shuffle=True)
    if any(s.stats.compiles != 1 for s in steps):
        raise SystemExit(f"{name}: the tpudist step compiled {[s.stats.compiles for s in steps]} times")
    if name == "pipeline":
        extra.update(_bubble(times, micro, DEVICES), microbatches=micro)
    memory = step.memory()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"layout": name, "mesh": " x ".join(f"{a} {n}" for a, n in axes.items()),
            "tpudist_ms": times["tpudist"].median * 1e3, "jax_ms": times["jax"].median * 1e3,
            "ratio": times["tpudist"].median / times["jax"].median,
            "params_per_device": max(memory.parameters.values()), "params_bytes": total,
            "xla_peak": memory.executable.peak if memory.executable else None,
            "first_loss": losses, **extra, "shardings": {n: str(s) for n, s in specs.items()}}


def _bubble_cell(row: dict[str, Any]) -> str | None:
    if "bubble_ticks" not in row:
        return None
    return f"{row['bubble_tpudist']:.2f} / {row['bubble_jax']:.2f} ({row['bubble_ticks']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    layouts = ("experts", "context", "pipeline")
    parser.add_argument("--layouts", nargs="+", choices=layouts, default=list(layouts))
    parser.add_argument("--hidden", type=int, default=256, help="experts: the layer's width")
    parser.add_argument("--intermediate", type=int, default=512, help="experts: each expert's hidden width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="experts: global batch x sequence")
    parser.add_argument("--width", type=int, default=128, help="context, pipeline: the decoder's width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2, help="context: the global batch")
    parser.add_argument("--seq", type=int, default=512, help="context: the sequence length")
    parser.add_argument("--pipeline-layers", type=int, default=4, help="pipeline: the decoder's blocks")
    parser.add_argument("--microbatches", type=int, default=8, help="pipeline: M, micro-batches per step")
    parser.add_argument("--pipeline-rows", type=int, default=32, help="pipeline: the batch (a multiple of 4 M)")
    parser.add_argument("--pipeline-seq", type=int, default=64, help="pipeline: the sequence length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    _bench.add_output_args(parser, "layouts")
    args = parser.parse_args()
    os.environ.setdefault("TPUDIST_CPU_DEVICES", str(DEVICES))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import tpudist
    tpudist.init()
    rows = [measure(name, args) for name in args.layouts]
    columns = [("layout", "layout", "s"), ("mesh", "mesh", "s"), ("tpudist ms", "tpudist_ms", ".2f"),
               ("jax ms", "jax_ms", ".2f"), ("tpudist/jax", "ratio", ".2f"),
               ("params/device", "params_per_device", "bytes"), ("params", "params_bytes", "bytes"),
               ("XLA peak", "xla_peak", "bytes"), ("bubble tpudist / jax (ticks)", _bubble_cell)]
    print(_bench.table(rows, columns, title=f"AdamW, {DEVICES} CPU devices; experts: MixtralSparseMoeBlock hidden "
                       f"{args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}, "
                       f"{args.tokens} tokens; context: decoder width {args.width}, {args.layers} layers, "
                       f"batch {args.rows} x {args.seq}; pipeline: decoder width {args.width}, "
                       f"{args.pipeline_layers} layers, batch {args.pipeline_rows} x {args.pipeline_seq} in "
                       f"{args.microbatches} micro-batches. Target tpudist/jax <= 1.15"))
    _bench.Output.from_args(args).write({"config": vars(args), "rows": rows}, announce=True)


if __name__ == "__main__":
    main()
