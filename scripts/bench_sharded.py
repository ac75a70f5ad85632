"""The sharded fused step on a Llama decoder: memory per device and step time per layout, against
the same model written by hand in JAX with the same layout.

    python scripts/bench_sharded.py                          # 4 CPU devices, every layout
    python scripts/bench_sharded.py --layouts fsdp tp --layers 2 --rounds 3

One process with 4 XLA CPU devices (TPUDIST_CPU_DEVICES). For each layout, a
`transformers.LlamaForCausalLM` (random init, seeded alike each time) trains with AdamW through
`tpudist.compile_train_step(..., mesh=, sharding=)`:

- dp: no sharding, mesh {"data": -1} (the per-device data-parallel step);
- fsdp: {"fsdp": -1}, sharding="fsdp";
- tp: {"data": -1, "model": 2}, sharding="llama";
- fsdp_tp: {"fsdp": -1, "model": 2}, tpudist.Sharding(fsdp=True, tp="llama").

Four sides per layout, interleaved run by run (scripts/_bench.py), two from each framework:

- tpudist_scan: tpudist's step at its defaults, a model's identical layers lowered as one
  `lax.scan` (TPUDIST_SCAN_LAYERS);
- tpudist_noscan: the same with TPUDIST_SCAN_LAYERS=0 while it captures, every layer on its own;
- jax_unrolled: the model written by hand in JAX (scripts/_jax_llama.py: jax.jit, optax.adamw,
  each parameter and its moments laid out by the `PartitionSpec` `step.shardings()` reports, the
  batch split over the same axes), its layers a Python loop;
- jax_scan: the same model with the layers' parameters stacked along a new leading dim (laid out
  as each layer's, after a leading None) and run under one `jax.lax.scan`, no remat.

The like-for-like ratios are tpudist_scan / jax_scan and tpudist_noscan / jax_unrolled: on
XLA:CPU the scan itself costs time in either framework (1.1-1.6x over unrolled at the defaults). tpudist is handed the host batch
(torch tensors) each step, JAX its batch already placed, as a JAX user holds it (a 4 KiB copy at
the defaults). Every side's first-step loss (same weights, same batch) must agree (LOSS_RTOL).

Memory: the most parameter + optimizer bytes on one device (`step.memory()`), against the whole
state (parameters and both AdamW moments, unsplit) over 4 devices and over `split`, the devices a
layout splits its large parameters over (dp 1, fsdp 4, tp 2, fsdp_tp 4); and XLA's estimate of
each step's peak per device. `--skip tpudist_noscan jax_scan` leaves sides out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import _bench
import _plots

DEVICES = 4
# name: (mesh axes, sharding: None, "fsdp", a preset, or "fsdp+<preset>" for tpudist.Sharding(fsdp=True, tp=preset))
LAYOUTS: dict[str, tuple[dict[str, int], str | None]] = {
    "dp": ({"data": -1}, None),
    "fsdp": ({"fsdp": -1}, "fsdp"),
    "tp": ({"data": -1, "model": 2}, "llama"),
    "fsdp_tp": ({"fsdp": -1, "model": 2}, "fsdp+llama"),
}
BATCH_AXES = ("data", "fsdp")
ADAM_MOMENTS = 2  # AdamW keeps two tensors per parameter: exp_avg, exp_avg_sq
LR, WEIGHT_DECAY = 1e-3, 0.01
LOSS_RTOL = 1e-4  # the first step's loss, same weights and batch: a port that differs in architecture misses this
SCAN_ENV = "TPUDIST_SCAN_LAYERS"  # tpudist's switch: 0 lowers every layer on its own, no lax.scan
SIDES = ("tpudist_scan", "tpudist_noscan", "jax_unrolled", "jax_scan")
OPTIONAL = ("tpudist_noscan", "jax_scan")  # --skip may leave these out
RATIOS = {"tpudist_scan_over_jax_scan": ("tpudist_scan", "jax_scan"),  # like for like: both scan their layers
          "tpudist_noscan_over_jax_unrolled": ("tpudist_noscan", "jax_unrolled")}  # both unroll them


def llama(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def sharding_of(name: str) -> Any:
    import tpudist
    sharding = LAYOUTS[name][1]
    if sharding and sharding.startswith("fsdp+"):
        return tpudist.Sharding(fsdp=True, tp=sharding.removeprefix("fsdp+"))
    return sharding


def split_over(mesh: Any, sharding: str | None) -> int:
    """The devices a layout splits its large parameters over: the fsdp and model axes it uses."""
    if sharding is None:
        return 1
    axes = dict(mesh.shape)
    fsdp = axes.get("fsdp", 1) if sharding.startswith("fsdp") else 1
    model = axes.get("model", 1) if sharding != "fsdp" else 1
    return fsdp * model


def check_same_model(model: Any, spec: Any) -> int:
    """The parameter count, after checking that the JAX port has every torch parameter, same shape."""
    import _jax_llama as jl
    torch_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    jax_shapes = spec.shapes()
    if torch_shapes != jax_shapes:
        differ = sorted(n for n in set(torch_shapes) | set(jax_shapes) if torch_shapes.get(n) != jax_shapes.get(n))
        raise SystemExit("the JAX port's parameters differ from LlamaForCausalLM's: " + ", ".join(
            f"{n}: torch {torch_shapes.get(n)} jax {jax_shapes.get(n)}" for n in differ[:6]))
    torch_count = sum(p.numel() for p in model.parameters())
    jax_count = jl.count(jax_shapes)
    if torch_count != jax_count:
        raise SystemExit(f"parameter counts differ: torch {torch_count}, JAX {jax_count}")
    return torch_count


def held_bytes(tree: Any) -> dict[int, int]:
    """Bytes of `tree`'s arrays on each device, from their shards."""
    import jax
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


@contextlib.contextmanager
def layers_unscanned() -> Iterator[None]:
    """TPUDIST_SCAN_LAYERS=0 while a step captures (its first call): every layer lowered on its
    own, as the JAX port writes them, instead of one `lax.scan` over the layers."""
    before = os.environ.get(SCAN_ENV)
    os.environ[SCAN_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SCAN_ENV]
        else:
            os.environ[SCAN_ENV] = before


def tpudist_step(name: str, args: argparse.Namespace, mesh: Any, batch: Any, scan: bool) -> tuple[Any, float]:
    """(step, first loss): the layout's compiled step on a fresh model, compiled by its first call."""
    import torch
    import tpudist
    model = llama(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    step = tpudist.compile_train_step(model, None, opt, mesh=mesh, sharding=sharding_of(name))
    with contextlib.nullcontext() if scan else layers_unscanned():
        return step, float(step(batch))


def state_bytes(memory: Any) -> dict[int, int]:
    """Parameter + optimizer bytes per device of a `StepMemory`."""
    return {d: memory.parameters.get(d, 0) + memory.optimizer.get(d, 0)
            for d in set(memory.parameters) | set(memory.optimizer)}


@dataclasses.dataclass
class JaxSide:
    """The hand-written JAX step, its state held between calls (donated each step)."""

    train: Any
    held: list[Any]
    ids: Any
    peak: int | None

    def __call__(self) -> Any:
        new_params, new_opt, loss = self.train(*self.held, self.ids)
        self.held[:] = [new_params, new_opt]
        return loss


def jax_side(spec: Any, model: Any, specs: dict[str, Any], mesh: Any, ids: Any, scan: bool) -> JaxSide:
    """The JAX port of `model` laid out by tpudist's `specs`, its layers unrolled or under `lax.scan`."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import _jax_llama as jl
    param_shardings = {n: NamedSharding(mesh, specs[n]) for n in specs}
    batch_sharding = NamedSharding(mesh, P(tuple(a for a in mesh.axis_names if a in BATCH_AXES)))
    train, params, opt_state = jl.train_step(spec, jl.params_from(model), param_shardings, batch_sharding,
                                             lr=LR, weight_decay=WEIGHT_DECAY, scan=scan)
    jax_ids = jax.device_put(ids.numpy().astype(np.int32), batch_sharding)
    peak = jl_peak(train.lower(params, opt_state, jax_ids).compile())
    return JaxSide(train, [params, opt_state], jax_ids, peak)


def check_losses(name: str, losses: dict[str, float]) -> None:
    """Every side's first-step loss within LOSS_RTOL of tpudist's, and the scanned port's of the unrolled's."""
    pairs = [("jax_scan", "jax_unrolled")] if "jax_scan" in losses else []
    pairs += [(side, "tpudist_scan") for side in losses if side != "tpudist_scan"]
    for side, anchor in pairs:
        if abs(losses[side] - losses[anchor]) > LOSS_RTOL * abs(losses[anchor]):
            raise SystemExit(f"{name}: first-step loss of {side} {losses[side]:.6f} != {anchor}'s "
                             f"{losses[anchor]:.6f} (same weights, same batch): the models are not the same")


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One layout's row: tpudist's step, scanned and not, against the JAX port, unrolled and scanned."""
    import jax
    import torch
    import _jax_llama as jl
    import tpudist

    axes, sharding = LAYOUTS[name]
    sides = [s for s in SIDES if s not in args.skip]
    model = llama(args)
    spec = jl.Spec.of(model.config)
    params = check_same_model(model, spec)
    total = sum(p.numel() * p.element_size() for p in model.parameters()) * (1 + ADAM_MOMENTS)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    batch = {"input_ids": ids, "labels": ids}
    mesh = tpudist.mesh.make_mesh(axes)
    steps, losses = {}, {}
    for side in (s for s in sides if s.startswith("tpudist")):
        steps[side], losses[side] = tpudist_step(name, args, mesh, batch, scan=side == "tpudist_scan")
    step = steps["tpudist_scan"]
    specs = step.shardings()
    ports = {side: jax_side(spec, model, specs, mesh, ids, scan=side == "jax_scan")
             for side in sides if side.startswith("jax")}
    losses.update({side: float(port()) for side, port in ports.items()})
    check_losses(name, losses)

    timed = {side: _bench.Side(lambda s=s: s(batch), float) for side, s in steps.items()}
    timed.update({side: _bench.Side(port, jax.block_until_ready) for side, port in ports.items()})
    times = _bench.interleave(timed, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                              settle_s=_bench.SETTLE_S, shuffle=True)
    for side, s in steps.items():
        if s.stats.compiles != 1:
            raise SystemExit(f"{name}: the {side} step compiled {s.stats.compiles} times; its time includes compiles")

    memory = step.memory()
    state = state_bytes(memory)
    split = split_over(mesh, sharding)
    ms = {side: t.median * 1e3 for side, t in times.items()}
    executables = {side: (memory if side == "tpudist_scan" else s.memory()).executable for side, s in steps.items()}
    peaks = {f"{side}_xla_peak": e.peak if e else None for side, e in executables.items()}
    return {
        "layout": name, "mesh": "x".join(f"{a}{n}" for a, n in mesh.shape.items()), "sharding": sharding,
        "params": params, "state_bytes": total, "split": split,
        "state_per_device": state, "state_max": max(state.values()),
        "jax_state_max": max(held_bytes(ports["jax_unrolled"].held).values()),
        "over_quarter": max(state.values()) / (total / DEVICES), "over_split": max(state.values()) / (total / split),
        **peaks, **{f"{side}_xla_peak": port.peak for side, port in ports.items()},
        **{f"{side}_ms": t for side, t in ms.items()},
        **{key: ms[a] / ms[b] for key, (a, b) in RATIOS.items() if a in ms and b in ms},
        "first_loss": losses, "shardings": {n: str(s) for n, s in specs.items()},
    }


def jl_peak(compiled: Any) -> int | None:
    """XLA's peak estimate of a compiled JAX step, as `ExecutableMemory.peak` counts it."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
               - stats.alias_size_in_bytes)


def _mib(key: str) -> Any:
    return lambda row: None if row.get(key) is None else row[key] / (1 << 20)


COLUMNS = [("layout", "layout", "s"), ("mesh", "mesh", "s"), ("split", "split", "d"),
           ("state/dev MiB", _mib("state_max"), ".2f"), ("jax state/dev", _mib("jax_state_max"), ".2f"),
           ("/ (total/4)", "over_quarter", "x"), ("/ (total/split)", "over_split", "x"),
           ("XLA peak MiB: tpudist scan", _mib("tpudist_scan_xla_peak"), ".2f"),
           ("noscan", _mib("tpudist_noscan_xla_peak"), ".2f"), ("jax unrolled", _mib("jax_unrolled_xla_peak"), ".2f"),
           ("jax scan", _mib("jax_scan_xla_peak"), ".2f"),
           ("ms: tpudist scan", "tpudist_scan_ms", ".1f"), ("tpudist noscan", "tpudist_noscan_ms", ".1f"),
           ("jax unrolled", "jax_unrolled_ms", ".1f"), ("jax scan", "jax_scan_ms", ".1f"),
           ("tpudist scan / jax scan", "tpudist_scan_over_jax_scan", "x"),
           ("tpudist noscan / jax unrolled", "tpudist_noscan_over_jax_unrolled", "x")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="the global batch (rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per side (the median is reported)")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side after the first")
    parser.add_argument("--skip", nargs="*", choices=OPTIONAL, default=[],
                        help=f"sides to leave out: tpudist_noscan (tpudist with {SCAN_ENV}=0, every layer lowered "
                             "on its own), jax_scan (the JAX port's layers under lax.scan)")
    _bench.add_output_args(parser, "sharded")
    args = parser.parse_args()
    # before JAX starts: tpudist.init() turns this into XLA's host device count
    os.environ.setdefault("TPUDIST_CPU_DEVICES", str(DEVICES))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import tpudist
    tpudist.init()
    if len(tpudist.devices()) != DEVICES:
        raise SystemExit(f"this benchmark needs {DEVICES} devices; JAX has {len(tpudist.devices())} "
                         f"(TPUDIST_CPU_DEVICES={os.environ.get('TPUDIST_CPU_DEVICES')})")
    out, rows = _bench.Output.from_args(args), []
    config = {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads",
                                             "seq", "batch", "rounds", "steps", "warmup")}
    config[SCAN_ENV] = os.environ.get(SCAN_ENV)
    for name in args.layouts:
        rows.append(measure(name, args))
        print(_bench.table(rows[-1:], COLUMNS), flush=True)
        out.write({"config": config, "rows": rows})
    first = rows[0]
    title = (f"Llama {args.layers} layers, hidden {args.hidden}, {first['params']:,} parameters (torch = JAX port); "
             f"batch {args.batch} x {args.seq}, AdamW, {DEVICES} CPU devices. state = parameters + AdamW moments, "
             f"total {_bench.human_bytes(first['state_bytes'])}; 'state/dev' the most on one device; split = the "
             "devices a layout splits its large parameters over; 'scan': the decoder layers under one lax.scan "
             f"(tpudist's default, {SCAN_ENV}), 'noscan'/'unrolled': each layer lowered on its own. Targets: "
             "state/dev within 1.1x of total/split; tpudist scan / jax scan and tpudist noscan / jax unrolled "
             "(like for like) within 1.15x")
    print(_bench.table(rows, COLUMNS, title=title))
    out.write({"config": config, "rows": rows}, announce=True)
    out.picture(lambda png: _plots.time_bars(rows, png, keys=[f"{side}_ms" for side in SIDES],
                                             labels=["tpudist (lax.scan)", f"tpudist ({SCAN_ENV}=0)",
                                                     "jax.jit, unrolled", "jax.jit, lax.scan"],
                                             group="layout", title="sharded Llama step"))


if __name__ == "__main__":
    main()
