"""Expert parallelism: a mixture-of-experts layer trained through the fused step on an
"expert" x "fsdp" mesh, against the same layer and layout written by hand in JAX.

    python scripts/bench_experts.py                        # 4 CPU devices, mesh fsdp 2 x expert 2
    python scripts/bench_experts.py --experts 8 --tokens 1024 --rounds 5

One process with 4 XLA CPU devices (TPUDIST_CPU_DEVICES). The layer is `transformers`'
`MixtralSparseMoeBlock` (router, top-k, stacked experts; random init), trained on a mean-squared
error against a random target with AdamW:

- tpudist: `compile_train_step(block, mse, AdamW, mesh=, sharding=Sharding(fsdp=True, tp="experts"))`:
  the experts split over "expert" (and FSDP's half of each over "fsdp"), tokens sent to their
  experts' devices by all-to-all inside the step;
- jax: the same layer by hand (jax.jit, optax.adamw; router, softmax, top-k; a `shard_map` over the
  expert axis that sends each device's (token, expert) pairs to the experts' devices with
  `all_to_all`, runs them with `ragged_dot` and sends them back), each parameter and its moments
  laid out by the `PartitionSpec` `step.shardings()` reports.

Both first-step losses (same weights, same batch) must agree. Target: tpudist / jax within 1.15x.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import _bench

DEVICES = 4
LR, WEIGHT_DECAY = 3e-3, 0.1


def block(args: argparse.Namespace) -> Any:
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


def jax_step(args: argparse.Namespace, layer: Any, specs: dict[str, Any], mesh: Any) -> tuple[Any, Any, Any]:
    """(train, params, opt_state): the layer by hand, laid out as tpudist laid out its parameters."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    params = {n: jax.device_put(p.detach().numpy(), NamedSharding(mesh, specs[n])) for n, p in layer.named_parameters()}
    devices, k = mesh.shape["expert"], args.top_k
    local = args.experts // devices

    def experts(x, index, weights, gate_up, down):  # one device's tokens; its experts
        tokens, width = x.shape
        pairs = tokens * k
        expert = index.reshape(pairs)
        dest = expert // local
        order = jnp.argsort(expert, stable=True)  # by device, then expert (experts are contiguous per device)
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

    def loss_fn(p, x, target):
        flat = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(flat @ p["gate.weight"].T, axis=-1)
        top, index = lax.top_k(probs, k)
        top = top / top.sum(-1, keepdims=True)
        out = sharded(flat, index, top, p["experts.gate_up_proj"], p["experts.down_proj"])
        return jnp.mean((out.reshape(x.shape) - target) ** 2)

    opt = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    opt_state = opt.init(params)

    @jax.jit
    def train(p, s, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, target)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss
    return train, params, opt_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="global batch x sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    _bench.add_output_args(parser, "experts")
    args = parser.parse_args()
    os.environ.setdefault("TPUDIST_CPU_DEVICES", str(DEVICES))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import torch
    from jax.sharding import NamedSharding, PartitionSpec as P
    import tpudist
    tpudist.init()
    mesh = tpudist.mesh.make_mesh({"fsdp": 2, "expert": 2})
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(4, args.tokens // 4, args.hidden, generator=g)
    target = torch.randn(4, args.tokens // 4, args.hidden, generator=g)
    layer = block(args)
    step = tpudist.compile_train_step(layer, torch.nn.functional.mse_loss, torch.optim.AdamW(
        layer.parameters(), lr=LR, weight_decay=WEIGHT_DECAY), mesh=mesh,
        sharding=tpudist.Sharding(fsdp=True, tp="experts"))
    fresh = block(args)  # the same weights, before tpudist's first step
    train, params, opt_state = jax_step(args, fresh, step.shardings(), mesh)
    batch = NamedSharding(mesh, P("fsdp"))
    jx, jt = (jax.device_put(t.numpy(), batch) for t in (x, target))
    losses = {"tpudist": float(step((x, target)))}
    held = [params, opt_state]

    def jax_side():
        held[0], held[1], loss = train(held[0], held[1], jx, jt)
        return loss
    losses["jax"] = float(jax_side())
    if abs(losses["jax"] - losses["tpudist"]) > 1e-4 * abs(losses["tpudist"]):
        raise SystemExit(f"first-step losses differ: {losses} (same weights, same batch): not the same layer")
    times = _bench.interleave({"tpudist": _bench.Side(lambda: step((x, target)), float),
                               "jax": _bench.Side(jax_side, jax.block_until_ready)},
                              rounds=args.rounds, steps=args.steps, warmup=2, shuffle=True)
    if step.stats.compiles != 1:
        raise SystemExit(f"the tpudist step compiled {step.stats.compiles} times")
    memory = step.memory()
    experts_bytes = sum(p.numel() * 4 for n, p in layer.named_parameters() if "experts" in n)
    row = {"mesh": "fsdp2 x expert2", "experts": args.experts, "tokens": args.tokens, "hidden": args.hidden,
           "tpudist_ms": times["tpudist"].median * 1e3, "jax_ms": times["jax"].median * 1e3,
           "ratio": times["tpudist"].median / times["jax"].median,
           "params_per_device": max(memory.parameters.values()), "experts_bytes": experts_bytes,
           "first_loss": losses, "shardings": {n: str(s) for n, s in step.shardings().items()}}
    columns = [("mesh", "mesh", "s"), ("experts", "experts"), ("tokens", "tokens"),
               ("tpudist ms", "tpudist_ms", ".2f"), ("jax ms", "jax_ms", ".2f"), ("tpudist/jax", "ratio", ".2f"),
               ("params/device", "params_per_device", "bytes"), ("experts total", "experts_bytes", "bytes")]
    print(_bench.table([row], columns, title=f"MixtralSparseMoeBlock, hidden {args.hidden}, intermediate "
                       f"{args.intermediate}, top-{args.top_k}, AdamW, {DEVICES} CPU devices; target tpudist/jax <= 1.15"))
    _bench.Output.from_args(args).write({"config": vars(args), "rows": [row]}, announce=True)


if __name__ == "__main__":
    main()
