"""bench_torch.py's `single`, `hf` and `dp` modes: tpudist's compiled and fused torch steps against
eager torch and torch DDP, the sides interleaved run by run in the same process (scripts/_bench.py).

- single / hf: forward+backward (`zero_grad(); loss = model_with_loss(*inputs, target);
  loss.backward()`), eager vs `tpudist.compile(model)`, and a whole SGD-momentum train step, eager
  vs `tpudist.compile_train_step` (one XLA executable); the reference models of
  examples/torch_models.py (single) or `transformers` models built from configs (hf).
- dp: `tpudist.compile_train_step` (in-graph gradient all-reduce) vs torch DDP over gloo, in N
  spawned processes, each on its share of the global batch.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable

import torch

import _bench
import _plots
import tpudist

torch_models = _bench.example("torch_models")
REFERENCES, WithLoss = torch_models.REFERENCES, torch_models.WithLoss
HF_MODELS = ("resnet18", "bert_tiny")


def ready(result: Any) -> None:
    """Waits for a step's result: the fused step returns its loss without waiting for the step."""
    if isinstance(result, tpudist.LazyScalar):
        float(result)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _check(name: str, batch: int, eager: float, compiled: float) -> None:
    if not abs(eager - compiled) <= 1e-3 * max(1.0, abs(eager)):
        raise AssertionError(f"{name} batch {batch}: compiled loss {compiled} != eager {eager}")


def _row(name: str, batch: int, device: str, model: torch.nn.Module, steps: dict[str, Callable[[], Any]],
         first: dict[str, float], losses: tuple[float, float], capture_s: float, args: Any,
         sync: Callable[[], None]) -> dict[str, Any]:
    """Times the four sides (eager, compiled, eager_train, fused) interleaved; one result row."""
    times = _bench.interleave({side: _bench.Side(step, wait=ready) for side, step in steps.items()},
                              rounds=args.repeats, steps=args.steps, warmup=args.warmup,
                              settle_s=_bench.SETTLE_S, sync=sync)
    ms = {side: t.median * 1e3 for side, t in times.items()}
    return {
        "model": name, "batch": batch, "device": device, "params": sum(p.numel() for p in model.parameters()),
        "eager_ms": ms["eager"], "compiled_ms": ms["compiled"], "speedup": ms["eager"] / ms["compiled"],
        "eager_train_ms": ms["eager_train"], "fused_train_ms": ms["fused"],
        "fused_speedup": ms["eager_train"] / ms["fused"],
        "loss_eager": losses[0], "loss_compiled": losses[1],
        "first_call_s": first["compiled"], "fused_first_call_s": first["fused"], "capture_s": capture_s,
    }


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def bench_model(name: str, batch: int, args: Any) -> dict[str, Any]:
    """One `single` row for `name` at `batch`, with the model and the batch on `args.device`."""
    ref, device = REFERENCES[name], args.device
    torch.manual_seed(0)
    model = ref.build("bench").to(device)
    inputs, target = ref.batch("bench", batch, torch.Generator().manual_seed(0))
    inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
    sync = _sync(device)
    eager = WithLoss(copy.deepcopy(model), ref.loss)
    train_model, fused_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = tpudist.compile(WithLoss(model, ref.loss))
    opt = sgd(train_model.parameters())
    fused = tpudist.compile_train_step(fused_model, ref.loss, sgd(fused_model.parameters()))
    batch_tuple = (*inputs, target)

    def fb(module: torch.nn.Module, params: list) -> Callable[[], None]:
        def step() -> None:
            for p in params:
                p.grad = None
            module(*inputs, target).backward()
        return step

    def eager_train() -> None:
        opt.zero_grad()
        ref.loss(train_model(*inputs), target).backward()
        opt.step()

    steps = {"eager": fb(eager, list(eager.parameters())), "compiled": fb(compiled, list(model.parameters())),
             "eager_train": eager_train, "fused": lambda: fused(batch_tuple)}
    first = {"compiled": _bench.first_call(steps["compiled"], sync)[1]}  # capture + XLA compile
    with torch.no_grad():  # the two sides must agree before their times mean anything
        losses = float(eager(*inputs, target)), float(compiled(*inputs, target))
    _check(name, batch, *losses)
    first["fused"] = _bench.first_call(steps["fused"], sync)[1]
    row = _row(name, batch, device, model, steps, first, losses, compiled.stats.capture_seconds, args, sync)
    assert compiled.stats.compiles == 1, compiled.stats
    assert fused.stats.compiles == 1, fused.stats
    return row


def _hf_models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], dict]]]:
    """name -> (build the model, make a batch of n): the `hf` models, random weights."""
    import transformers as T

    def resnet18() -> torch.nn.Module:
        return T.ResNetForImageClassification(T.ResNetConfig(
            embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic",
            num_labels=10))

    def bert_tiny() -> torch.nn.Module:  # google/bert_uncased_L-2_H-128_A-2's shape
        return T.BertForSequenceClassification(T.BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, num_labels=2))

    def images(n: int) -> dict:
        g = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(n, 3, 64, 64, generator=g),
                "labels": torch.randint(0, 10, (n,), generator=g)}

    def tokens(n: int) -> dict:
        g = torch.Generator().manual_seed(0)
        return {"input_ids": torch.randint(0, 30522, (n, 128), generator=g),
                "attention_mask": torch.ones(n, 128, dtype=torch.int64),
                "labels": torch.randint(0, 2, (n,), generator=g)}

    return {"resnet18": (resnet18, images), "bert_tiny": (bert_tiny, tokens)}


def bench_hf(name: str, batch: int, args: Any) -> dict[str, Any]:
    """One `hf` row: forward+backward of the model's own loss (`model(**batch).loss`), eager vs
    `tpudist.compile`, and a whole SGD-momentum step, eager vs `compile_train_step(model, None, opt)`."""
    build, make_batch = _hf_models()[name]
    device = args.device
    torch.manual_seed(0)
    model = build().to(device).train()
    data = {k: v.to(device) for k, v in make_batch(batch).items()}
    sync = _sync(device)
    eager, train_model, fused_model = (copy.deepcopy(model) for _ in range(3))
    compiled = tpudist.compile(model)
    opt = sgd(train_model.parameters())
    fused = tpudist.compile_train_step(fused_model, None, sgd(fused_model.parameters()))

    def fb(module: torch.nn.Module, params: list) -> Callable[[], None]:
        def step() -> None:
            for p in params:
                p.grad = None
            module(**data).loss.backward()
        return step

    def eager_train() -> None:
        opt.zero_grad()
        train_model(**data).loss.backward()
        opt.step()

    steps = {"eager": fb(eager, list(eager.parameters())), "compiled": fb(compiled, list(model.parameters())),
             "eager_train": eager_train, "fused": lambda: fused(data)}
    first = {"compiled": _bench.first_call(steps["compiled"], sync)[1]}
    steps["eager"]()  # the same train-mode forward on both sides: BatchNorm's running statistics agree
    eager.eval()
    model.eval()
    with torch.no_grad():  # in eval mode: no dropout, so the two sides must agree
        losses = float(eager(**data).loss), float(compiled(**data).loss)
    eager.train()
    model.train()
    _check(name, batch, *losses)
    first["fused"] = _bench.first_call(lambda: float(fused(data)))[1]
    return _row(name, batch, device, model, steps, first, losses, compiled.stats.capture_seconds, args, sync)


def _data_parallel_worker(index: int, models: list[str], batches: list[int], steps: int, repeats: int,
                          warmup: int, threads: int) -> list[dict[str, Any]]:
    """In each spawned process: torch DDP (gloo) and the fused step on the same model, optimizer and
    share of the global batch, interleaved; each run starts at a barrier (no time-based settling:
    every rank must run the same steps). With more than one process, two more sides: the fused step
    with one all-reduce per gradient array, and the same step over this process's own device only
    (no gradient crosses processes: the compute floor, with every process busy at once)."""
    import jax
    import numpy as np
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="env://")   # tpudist's contract sets MASTER_ADDR/PORT
    count = dist.get_world_size()
    own_mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
    rows = []
    try:
        for name in models:
            for global_batch in batches:
                ref = REFERENCES[name]
                torch.manual_seed(0)
                model = ref.build("bench")
                ddp = DistributedDataParallel(copy.deepcopy(model))
                inputs, target = ref.batch("bench", global_batch // count, torch.Generator().manual_seed(index))
                opt = sgd(ddp.parameters())
                fused = tpudist.compile_train_step(model, ref.loss, sgd(model.parameters()))
                batch_tuple = (*inputs, target)

                def ddp_step() -> None:
                    opt.zero_grad()
                    ref.loss(ddp(*inputs), target).backward()
                    opt.step()

                _, first = _bench.first_call(lambda: ready(fused(batch_tuple)))
                sides = {"ddp": ddp_step, "fused": _bench.Side(lambda: fused(batch_tuple), ready)}
                if count > 1:
                    per_array_model, own_model = copy.deepcopy(model), copy.deepcopy(model)
                    per_array = tpudist.compile_train_step(per_array_model, ref.loss, sgd(per_array_model.parameters()))
                    own = tpudist.compile_train_step(own_model, ref.loss, sgd(own_model.parameters()), mesh=own_mesh)
                    os.environ["TPUDIST_GRAD_BUCKET_MB"] = "0"  # read when the step is built, at its first call
                    try:
                        ready(per_array(batch_tuple))
                    finally:
                        del os.environ["TPUDIST_GRAD_BUCKET_MB"]
                    sides["per_array"] = _bench.Side(lambda: per_array(batch_tuple), ready)
                    sides["own"] = _bench.Side(lambda: own(batch_tuple), ready)
                    sides["all_reduce"] = _gradient_mean(model)
                times = _bench.interleave(sides, rounds=repeats, steps=steps, warmup=warmup, before_run=dist.barrier)
                ms = {side: t.median * 1e3 for side, t in times.items()}
                rows.append({"model": name, "global_batch": global_batch, "processes": count,
                             "ddp_ms": ms["ddp"], "fused_ms": ms["fused"], "speedup": ms["ddp"] / ms["fused"],
                             "per_array_ms": ms.get("per_array"), "own_device_ms": ms.get("own"),
                             "all_reduce_ms": ms.get("all_reduce"),
                             "floor_ms": ms["own"] + ms["all_reduce"] if count > 1 else None,
                             "bucketing_speedup": ms["per_array"] / ms["fused"] if count > 1 else None,
                             "fused_first_call_s": first})
    finally:
        dist.destroy_process_group()
    return rows


def _gradient_mean(model: torch.nn.Module) -> "_bench.Side":
    """The fused step's gradient all-reduce alone (the same buckets, `_body.bucketed_mean`) on
    arrays of the model's gradient shapes: what the step's communication costs by itself."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    from tpudist.compile._torch.train._body import bucket_bytes, bucketed_mean
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    grads = [jnp.zeros(tuple(p.shape), jnp.float32) for p in model.parameters() if p.requires_grad]
    mean = tpudist.compile(lambda gs: bucketed_mean([jax.lax.pcast(g, "data", to="varying") for g in gs], "data",
                                                    bucket_bytes()),
                           mesh=mesh, per_device=True, in_specs=(P(),), out_specs=P("data"), name="gradient mean")
    return _bench.Side(lambda: mean(grads), lambda out: jax.block_until_ready(out))


def bench_data_parallel(args: Any) -> list[dict[str, Any]]:
    """The `dp` rows, for each process count: rank 0's timings (the processes run in lockstep), each
    against the one-process row of the same model and global batch (when measured)."""
    rows: list[dict[str, Any]] = []
    for processes in args.processes:
        rows += tpudist.spawn(_data_parallel_worker, nprocs=processes, cpu_devices=1, timeout=3600,
                              args=(args.models, args.batches, args.steps, args.repeats, args.warmup,
                                    args.process_threads or max(1, (os.cpu_count() or 1) // processes)))[0]
        print(f"  {processes} process(es) done", file=sys.stderr, flush=True)
    single = {(r["model"], r["global_batch"]): r for r in rows if r["processes"] == 1}
    for r in rows:
        one = single.get((r["model"], r["global_batch"]))
        r["fused_vs_one"] = r["fused_ms"] / one["fused_ms"] if one else None
        r["ddp_vs_one"] = r["ddp_ms"] / one["ddp_ms"] if one else None
    return rows


STEP_COLUMNS = [("model", "model", "s"), ("batch", "batch", "d"), ("params", "params", "d"),
                ("eager fb ms", "eager_ms", ".2f"), ("compiled fb", "compiled_ms", ".2f"), ("ratio", "speedup", "x"),
                ("eager step", "eager_train_ms", ".2f"), ("fused step", "fused_train_ms", ".2f"),
                ("ratio", "fused_speedup", "x")]
STEP_TITLE = ("forward+backward (fb) and whole SGD-momentum train step, ms (median); ratio = eager / compiled "
              "(>1: compiled faster)")
DP_COLUMNS = [("model", "model", "s"), ("global batch", "global_batch", "d"), ("procs", "processes", "d"),
              ("DDP ms", "ddp_ms", ".2f"), ("fused ms", "fused_ms", ".2f"), ("DDP / fused", "speedup", "x"),
              ("DDP / 1 proc", "ddp_vs_one", "x"), ("fused / 1 proc", "fused_vs_one", "x"),
              ("fused, own device ms", "own_device_ms", ".2f"), ("all-reduce alone ms", "all_reduce_ms", ".2f"),
              ("floor ms", "floor_ms", ".2f"),
              ("fused, 1 all-reduce per array ms", "per_array_ms", ".2f"), ("per array / bucketed", "bucketing_speedup", "x")]
DP_TITLE = ("data parallel at a fixed global batch: torch DDP (gloo) vs the fused XLA step, ms per step (median); "
            "/ 1 proc = this step time over the one-process step's (1.0: no cost for the split); own device = the "
            "fused step over each process's own device (no all-reduce: the compute floor with every process busy); "
            "all-reduce alone = the step's gradient all-reduce by itself; floor = the two added; "
            "1 all-reduce per array = TPUDIST_GRAD_BUCKET_MB=0")


def draw_steps(rows: list[dict[str, Any]], png: Any) -> Any:
    return _plots.time_bars(rows, png, keys=["eager_ms", "compiled_ms", "eager_train_ms", "fused_train_ms"],
                            labels=["eager fwd+bwd", "compiled fwd+bwd", "eager step", "fused step"],
                            group=["model", "batch"], log=True, title="eager torch vs tpudist (ms per step)")


def draw_dp(rows: list[dict[str, Any]], png: Any) -> Any:
    return _plots.time_bars(rows, png, keys=["ddp_ms", "fused_ms"], labels=["torch DDP (gloo)", "fused step"],
                            group=["model", "global_batch"], title="data parallel: DDP vs the fused step (ms per step)")
