"""Benchmark: training steps of each reference model through tpudist's torch -> XLA bridge vs
eager torch, and the fused data-parallel step vs torch DDP, side by side in one run, on this CPU.

    python scripts/bench_torch.py                       # all models, batch 64 and 256, then DDP
    python scripts/bench_torch.py --models mlp --batches 64 --json bench-results/torch.json

Single process, two comparisons per model and batch:
- forward+backward: `zero_grad(); loss = model_with_loss(*inputs, target); loss.backward()`,
  eager vs `tpudist.compile(model)` (the optimizer update is left out of both);
- a whole training step with SGD (momentum 0.9): eager `zero_grad / forward / backward /
  opt.step()` vs `tpudist.compile_train_step` (everything in one XLA executable).
`--vs-jax` compares with the engine's own floor: the same models written by hand in JAX
(`scripts/_jax_reference.py`: MLP 32-16-4 at batch 8, MLP 32-256-4 at batch 64, a transformer
block, ResNet-18 with BatchNorm), jitted with parameters and optimizer state donated, SGD with
momentum on both sides: the whole train step (eager torch, the fused step given torch tensors and
given its batch already on the devices as the JAX side's is, jax.jit) and
forward+backward (eager, `tpudist.compile(model)` with the loss in eager torch,
`tpudist.compile` of model and loss together, jax.jit of value_and_grad); ratios fused/JAX and
compiled/JAX. A second table puts the compiled forward+backward against torch's own share of it:
the same caller code around a module that computes nothing (`scripts/_autograd_floor.py`: the
module call, the loss, the autograd engine, a fresh `.grad` per parameter), alone ('floor') and
right after JAX's forward+backward waited for ('reach': the least any bridge that keeps torch's
autograd driving can cost, its host work run after an executable as it must be), and around
JAX's forward and backward as two executables, each waited for inside the module's forward and
backward ('reach split': the least for a bridge whose caller computes the loss in torch between
the two). A third table gives each side's CPU per step: the calling thread's (the host's work:
launching, staging a batch, torch's share) and the whole process's (with XLA's threads), which
other tenants of a shared machine move less than wall time. Each side's time is the median over
`--repeats` runs of `--steps` steps (a run ends when its last result is ready), the sides
interleaved run by run.

`--hf` adds third-party models as users bring them, from `transformers` configs (random
weights): ResNet-18 (`ResNetForImageClassification`, batch 4 x 3 x 64 x 64) and BERT-tiny (2 layers,
hidden 128, sequence 128), each trained on its own loss (`model(**batch).loss`), the same two
comparisons. Data parallel (`--dp-processes`, default 2, spawned with tpudist.spawn): torch
DistributedDataParallel over gloo vs the fused step, each process on its share of the global
batch, same model and optimizer.

`--device cuda` runs the single-process comparison on a GPU: eager torch on CUDA tensors vs the
same bridge with XLA on JAX's GPU backend (tensors cross through DLPack, zero-copy); both sides
synchronize the device at the end of each timed run, and TF32 matmuls are allowed on both (XLA's
default for float32 on GPU; `--no-tf32` makes both full float32). The data-parallel part is CPU only.

Each side runs warm-up steps (compiled sides compile in the first), then `--repeats` timed runs
of `--steps` steps; the best run is reported, since on a shared machine noise only ever adds
time, and the sides alternate run by run so that load from other processes hits them alike.
Prints the tables, then the JSON (also written to --json when given); with --json it also draws
`<json stem>.png` beside it: per-model time bars (scripts/_plots.py, matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tpudist  # noqa: E402
from _autograd_floor import Floor  # noqa: E402
from torch_models import REFERENCES, WithLoss  # noqa: E402


def _time_interleaved(steps_by_side: dict[str, Callable[[], Any]], steps: int, repeats: int,
                      sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Best mean seconds per step of each side over `repeats` runs of `steps` steps. The sides
    alternate run by run, so a burst of load from other processes hits both alike. `sync` waits
    for the device (a GPU runs asynchronously) before a run's clock stops."""
    best = {side: float("inf") for side in steps_by_side}
    for _ in range(repeats):
        for side, step in steps_by_side.items():
            _settle(step, _wait)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                result = step()
            _wait(result)
            sync()
            best[side] = min(best[side], (time.perf_counter() - start) / steps)
    return best


SETTLE_SECONDS = 0.15


def _settle(step: Callable[[], Any], wait: Callable[[Any], Any]) -> None:
    """Untimed steps of one side for SETTLE_SECONDS before its timed run. Measured here: after the
    cores ran one thread (eager torch at 1 thread) or slept for 0.5 s, the first ~10 steps of the
    transformer block's XLA step (2 threads) took 1.5-3x as long as the rest (30-60 ms in all), so
    a side timed right after eager torch paid for it."""
    start = time.perf_counter()
    while True:
        wait(step())
        if time.perf_counter() - start >= SETTLE_SECONDS:
            return


def _wait(result: Any) -> None:
    """Waits for a step's result: the fused step returns its loss without waiting for the step."""
    if isinstance(result, tpudist.LazyScalar):
        float(result)


def _step_fn(module: torch.nn.Module, params: list[torch.nn.Parameter], inputs: tuple, target: torch.Tensor):
    def step() -> None:
        for p in params:
            p.grad = None
        module(*inputs, target).backward()
    return step


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _eager_train_step(model: torch.nn.Module, loss_fn, opt: torch.optim.Optimizer, inputs: tuple,
                      target: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        loss_fn(model(*inputs), target).backward()
        opt.step()
    return step


def bench_model(name: str, batch: int, steps: int, repeats: int, warmup: int,
                device: str = "cpu") -> dict[str, Any]:
    """One row for `name` at `batch`: forward+backward ms/step eager vs `tpudist.compile`d, and a
    whole training step (forward, backward, SGD momentum) eager vs the fused XLA step, with the
    model and the batch on `device`."""
    ref = REFERENCES[name]
    torch.manual_seed(0)
    model = ref.build("bench").to(device)
    inputs, target = ref.batch("bench", batch, torch.Generator().manual_seed(0))
    inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    eager = WithLoss(copy.deepcopy(model), ref.loss)
    train_model = copy.deepcopy(model)
    fused_model = copy.deepcopy(model)
    compiled = tpudist.compile(WithLoss(model, ref.loss))

    eager_step = _step_fn(eager, list(eager.parameters()), inputs, target)
    compiled_step = _step_fn(compiled, list(model.parameters()), inputs, target)
    eager_train = _eager_train_step(train_model, ref.loss, _sgd(train_model.parameters()), inputs, target)
    fused = tpudist.compile_train_step(fused_model, ref.loss, _sgd(fused_model.parameters()))
    batch_tuple = (*inputs, target)

    def fused_step() -> Any:
        return fused(batch_tuple)

    start = time.perf_counter()
    compiled_step()  # capture + XLA compile of forward and backward
    sync()
    first_call = time.perf_counter() - start
    with torch.no_grad():  # the two sides must agree before their times mean anything
        loss_eager, loss_compiled = float(eager(*inputs, target)), float(compiled(*inputs, target))
    if not abs(loss_eager - loss_compiled) <= 1e-3 * max(1.0, abs(loss_eager)):
        raise AssertionError(f"{name} batch {batch}: compiled loss {loss_compiled} != eager {loss_eager}")
    start = time.perf_counter()
    fused_step()
    sync()
    fused_first = time.perf_counter() - start
    for _ in range(warmup):
        for step in (eager_step, compiled_step, eager_train, fused_step):
            step()
    times = _time_interleaved({"eager": eager_step, "compiled": compiled_step, "eager_train": eager_train,
                               "fused": fused_step}, steps, repeats, sync)
    assert compiled.stats.compiles == 1, compiled.stats
    assert fused.stats.compiles == 1, fused.stats
    return {
        "model": name, "batch": batch, "device": device,
        "params": sum(p.numel() for p in model.parameters()),
        "eager_ms": times["eager"] * 1e3, "compiled_ms": times["compiled"] * 1e3,
        "speedup": times["eager"] / times["compiled"],
        "eager_train_ms": times["eager_train"] * 1e3, "fused_train_ms": times["fused"] * 1e3,
        "fused_speedup": times["eager_train"] / times["fused"],
        "loss_eager": loss_eager, "loss_compiled": loss_compiled,
        "first_call_s": first_call, "fused_first_call_s": fused_first,
        "capture_s": compiled.stats.capture_seconds,
    }


def _median_times(sides: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]], steps: int,
                  repeats: int) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median seconds per step of each side (step function, wait-for-its-result), over `repeats`
    runs of `steps` steps; the sides alternate run by run, in an order shuffled each round (a side
    always timed right after the same one would carry that one's after-effects, see _settle).
    Also the median CPU seconds per step of the calling thread and of the whole process: less
    moved than wall time by other tenants of a shared machine."""
    import random
    import statistics
    runs: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}
    order, shuffle = list(sides), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for side in order:
            step, wait = sides[side]
            _settle(step, wait)
            start, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(steps):
                out = step()
            wait(out)
            runs[side].append(((time.perf_counter() - start) / steps, (time.thread_time() - thread) / steps,
                               (time.process_time() - process) / steps))
    return tuple({side: statistics.median(r[k] for r in rs) for side, rs in runs.items()} for k in range(3))


def bench_vs_jax(name: str, steps: int, repeats: int, warmup: int) -> dict[str, Any]:
    """One `--vs-jax` row: the train step and forward+backward of `name`, eager torch vs tpudist vs
    the same model written by hand in JAX."""
    import jax
    import numpy as np
    import torch.nn.functional as F

    import _jax_reference as jr
    ref = jr.MODELS[name]
    torch.manual_seed(0)
    model = ref.build()
    inputs, target = ref.batch(ref.batch_size, torch.Generator().manual_seed(0))
    eager_model, fused_model, fb_model, compiled_model, loss_model, floor_model = (copy.deepcopy(model)
                                                                                   for _ in range(6))
    sgd = lambda ps: torch.optim.SGD(ps, lr=jr.LR, momentum=jr.MOMENTUM)  # noqa: E731

    params, state = ref.params_from(model)
    train, forward_backward = jr.jax_steps(ref)
    x, y = jax.device_put(ref.jax_input(inputs[0])), jax.device_put(target.numpy().astype(np.int32))
    jax_loss = float(forward_backward(params, state, x, y)[0])
    with torch.no_grad():
        torch_loss = float(F.cross_entropy(copy.deepcopy(model)(*inputs), target))
    if not abs(jax_loss - torch_loss) <= 1e-4 * max(1.0, abs(torch_loss)):
        raise AssertionError(f"{name}: the JAX port's loss {jax_loss} != torch's {torch_loss}")
    held = [params, state, jr.optimizer_init(params)]
    fb_params, fb_state = ref.params_from(model)
    split_forward, split_backward = jr.jax_split(ref)
    one, split_held = jax.device_put(np.float32(1.0)), []

    def jax_forward() -> None:  # the split's two executables, each waited for where a bridge waits
        split_held[:] = [jax.block_until_ready(split_forward(fb_params, fb_state, x, y))[1]]

    def jax_backward() -> Any:
        return jax.block_until_ready(split_backward(split_held.pop(), one))

    def jax_step() -> Any:
        new_params, new_state, new_opt, loss = train(*held, x, y)
        held[:] = [new_params, new_state, new_opt]
        return loss

    opt = sgd(eager_model.parameters())

    def eager_step() -> Any:
        opt.zero_grad()
        loss = F.cross_entropy(eager_model(*inputs), target)
        loss.backward()
        opt.step()
        return loss

    fused = tpudist.compile_train_step(fused_model, F.cross_entropy, sgd(fused_model.parameters()))
    batch = (*inputs, target)
    compiled = tpudist.compile(compiled_model)
    with_loss = tpudist.compile(WithLoss(loss_model, F.cross_entropy))
    fb_params_torch, cm_params = list(fb_model.parameters()), list(compiled_model.parameters())
    # torch's own share: the same caller code around modules that compute nothing (_autograd_floor)
    with torch.no_grad():
        logits = copy.deepcopy(model)(*inputs)
        floor, floor_loss = Floor(floor_model, logits), Floor(floor_model, F.cross_entropy(logits, target))
        floor_split = Floor(floor_model, logits, run_forward=jax_forward, run_backward=jax_backward)
    floor_params = list(floor_model.parameters())

    def fb(module: torch.nn.Module, params: list, loss_inside: bool = False) -> Callable[[], Any]:
        def step() -> Any:
            for p in params:
                p.grad = None
            loss = module(*inputs, target) if loss_inside else F.cross_entropy(module(*inputs), target)
            loss.backward()
            return loss
        return step

    nothing, ready = (lambda out: None), (lambda out: jax.block_until_ready(out))

    def after_jax(torch_side: Callable[[], Any]) -> Callable[[], Any]:
        def step() -> Any:
            jax.block_until_ready(forward_backward(fb_params, fb_state, x, y))
            return torch_side()
        return step
    # the batch already on the devices, as the JAX side's is (what tpudist.device_loader and fit
    # hand the step, prepared while the previous step runs)
    device_batch = next(iter(tpudist.device_loader([batch])))
    sides = {"eager_step": (eager_step, nothing), "fused_step": (lambda: fused(batch), float),
             "fused_step_device": (lambda: fused(device_batch), float),
             "jax_step": (jax_step, ready),
             "eager_fb": (fb(fb_model, fb_params_torch), nothing), "compiled_fb": (fb(compiled, cm_params), nothing),
             "compiled_loss_fb": (fb(with_loss, list(loss_model.parameters()), loss_inside=True), nothing),
             "floor_fb": (fb(floor, floor_params), nothing),
             "floor_loss_fb": (fb(floor_loss, floor_params, loss_inside=True), nothing),
             # JAX's forward+backward waited for, then torch's share: what a bridge that keeps torch's
             # autograd driving costs at the least, its host work run right after an executable,
             # as it will be (caches cold: docs/torch.md)
             "reach_fb": (after_jax(fb(floor, floor_params)), nothing),
             "reach_loss_fb": (after_jax(fb(floor_loss, floor_params, loss_inside=True)), nothing),
             # the loss in torch between forward and backward splits them: JAX's split, each half
             # waited for where the bridge's runs, inside the floor
             "reach_split_fb": (fb(floor_split, floor_params), nothing),
             "jax_fb_split": (lambda: (jax_forward(), jax_backward()), nothing),
             "jax_fb": (lambda: forward_backward(fb_params, fb_state, x, y), ready),
             # the same, waited for call by call as a torch caller must (its loss is a real tensor)
             "jax_fb_waited": (lambda: jax.block_until_ready(forward_backward(fb_params, fb_state, x, y)), nothing)}
    first = {}
    for side, (step, wait) in sides.items():  # compiles happen here, timed apart
        start = time.perf_counter()
        wait(step())
        first[side] = time.perf_counter() - start
    for _ in range(warmup):
        for step, wait in sides.values():
            wait(step())
    times, thread_cpu, process_cpu = _median_times(sides, steps, repeats)
    row = {"model": name, "batch": ref.batch_size, "params": sum(p.numel() for p in model.parameters()),
           **{f"{side}_ms": t * 1e3 for side, t in times.items()},
           # the host's work per step: the calling thread's CPU (launching, staging, torch's share)
           # and the process's (with XLA's threads running the executables)
           **{f"{side}_thread_cpu_us": t * 1e6 for side, t in thread_cpu.items()},
           **{f"{side}_cpu_ms": t * 1e3 for side, t in process_cpu.items()},
           "fused_over_jax": times["fused_step"] / times["jax_step"],
           "fused_device_over_jax": times["fused_step_device"] / times["jax_step"],
           "eager_over_jax": times["eager_step"] / times["jax_step"],
           "compiled_over_jax": times["compiled_fb"] / times["jax_fb"],
           "compiled_loss_over_jax": times["compiled_loss_fb"] / times["jax_fb"],
           "compiled_loss_over_jax_waited": times["compiled_loss_fb"] / times["jax_fb_waited"],
           # the least a bridge that keeps torch's autograd driving can reach: the executable waited
           # for (the caller needs its result before going on), then torch's share
           "floor_over_jax": times["floor_fb"] / times["jax_fb"],
           "floor_loss_over_jax": times["floor_loss_fb"] / times["jax_fb"],
           "reachable_over_jax": times["reach_fb"] / times["jax_fb"],
           "reachable_loss_over_jax": times["reach_loss_fb"] / times["jax_fb"],
           "reachable_split_over_jax": times["reach_split_fb"] / times["jax_fb"],
           "compiled_over_reachable_split": times["compiled_fb"] / times["reach_split_fb"],
           "eager_fb_over_jax": times["eager_fb"] / times["jax_fb"],
           "fused_cpu_over_jax": process_cpu["fused_step"] / process_cpu["jax_step"],
           "fused_device_cpu_over_jax": process_cpu["fused_step_device"] / process_cpu["jax_step"],
           "first_call_s": first, "torch_threads": torch.get_num_threads()}
    assert fused.stats.compiles == 1 and compiled.stats.compiles == 1 and with_loss.stats.compiles == 1, \
        (fused.stats, compiled.stats, with_loss.stats)
    return row


def _columns(title: str, columns: list[tuple[str, str, int, str]], rows: list[dict[str, Any]]) -> str:
    """A text table: each column (header, row key, width, format), the format "s" (left-aligned
    text), "d" (an integer), "ms" (3 decimals), "us" (none) or "x" (a ratio, 2 decimals and an x)."""
    def cell(value: Any, width: int, form: str) -> str:
        if form == "s":
            return f"{value:<{width}}"
        if form == "x":
            return f"{value:>{width - 1}.2f}x"
        if form == "us":
            return f"{value:>{width}.0f}"
        return f"{value:>{width}d}" if form == "d" else f"{value:>{width}.3f}"
    header = "".join(f"{name:<{width}}" if form == "s" else f"{name:>{width}}" for name, _, width, form in columns)
    lines = [title, header, "-" * len(header)]
    lines += ["".join(cell(r[key], width, form) for _, key, width, form in columns) for r in rows]
    return "\n".join(lines)


def _jax_table(rows: list[dict[str, Any]]) -> str:
    return _columns(
        "vs the same model written by hand in JAX (jax.jit, donated), ms per step (median); "
        "ratio = tpudist / JAX (<= 1: at the engine's floor); 'on dev': the fused step given its batch "
        "on the devices (a DeviceBatch), as the JAX side's is; 'waited': JAX's fwd+bwd waited for "
        "call by call, as a compiled torch module's caller must",
        [("model", "model", 12, "s"), ("batch", "batch", 6, "d"), ("eager step", "eager_step_ms", 11, "ms"),
         ("fused", "fused_step_ms", 9, "ms"), ("on dev", "fused_step_device_ms", 9, "ms"),
         ("jax", "jax_step_ms", 9, "ms"), ("fused/jax", "fused_over_jax", 10, "x"),
         ("dev/jax", "fused_device_over_jax", 9, "x"), ("eager fb", "eager_fb_ms", 10, "ms"),
         ("compiled", "compiled_fb_ms", 10, "ms"), ("+loss", "compiled_loss_fb_ms", 9, "ms"),
         ("jax fb", "jax_fb_ms", 9, "ms"), ("waited", "jax_fb_waited_ms", 9, "ms"),
         ("compiled/jax", "compiled_over_jax", 13, "x"), ("+loss/jax", "compiled_loss_over_jax", 10, "x"),
         ("+loss/waited", "compiled_loss_over_jax_waited", 13, "x")], rows)


def _floor_table(rows: list[dict[str, Any]]) -> str:
    return _columns(
        "compiled forward+backward against torch's own share, ms (median): 'floor' is the same caller code "
        "around a module that computes nothing (scripts/_autograd_floor.py), loss in torch / '+loss' inside "
        "the module; 'reach' is JAX's forward+backward waited for, then that floor: the least a bridge that "
        "keeps torch's autograd driving can reach; 'split' is JAX's forward and backward as two executables "
        "and 'reach split' the floor running them, each waited for where a bridge that computes the loss in "
        "torch between them runs its own",
        [("model", "model", 12, "s"), ("jax fb", "jax_fb_ms", 9, "ms"), ("waited", "jax_fb_waited_ms", 9, "ms"),
         ("split", "jax_fb_split_ms", 9, "ms"), ("floor", "floor_fb_ms", 9, "ms"), ("+loss", "floor_loss_fb_ms", 9, "ms"),
         ("reach", "reach_fb_ms", 9, "ms"), ("+loss", "reach_loss_fb_ms", 9, "ms"),
         ("reach split", "reach_split_fb_ms", 12, "ms"), ("reach/jax", "reachable_over_jax", 10, "x"),
         ("+loss", "reachable_loss_over_jax", 8, "x"), ("split", "reachable_split_over_jax", 8, "x"),
         ("compiled/jax", "compiled_over_jax", 13, "x"), ("+loss", "compiled_loss_over_jax", 8, "x"),
         ("compiled/reach split", "compiled_over_reachable_split", 21, "x")], rows)


def _host_table(rows: list[dict[str, Any]]) -> str:
    return _columns(
        "CPU per step (median): 'thread' is the calling thread's, in us (the host's work: launching, "
        "staging a batch, torch's share), 'process' all threads', in ms (with XLA's running the "
        "executables); less moved than wall time by other tenants of a shared machine",
        [("model", "model", 12, "s"), ("thread: fused", "fused_step_thread_cpu_us", 14, "us"),
         ("on dev", "fused_step_device_thread_cpu_us", 8, "us"), ("jax", "jax_step_thread_cpu_us", 6, "us"),
         ("compiled+loss", "compiled_loss_fb_thread_cpu_us", 14, "us"),
         ("reach+loss", "reach_loss_fb_thread_cpu_us", 11, "us"),
         ("process: fused", "fused_step_cpu_ms", 15, "ms"), ("on dev", "fused_step_device_cpu_ms", 8, "ms"),
         ("jax", "jax_step_cpu_ms", 8, "ms"), ("fused/jax", "fused_cpu_over_jax", 10, "x"),
         ("dev/jax", "fused_device_cpu_over_jax", 9, "x")], rows)


def _draw(json_path: Path, rows: list[dict[str, Any]], jax_rows: list[dict[str, Any]]) -> str:
    """Per-model time bars beside the JSON (same stem, .png): the vs-JAX rows when there are any."""
    import _plots  # scripts/_plots.py
    png = json_path.with_suffix(".png")
    if jax_rows:
        _plots.time_bars(jax_rows, png, keys=["eager_step_ms", "fused_step_ms", "fused_step_device_ms", "jax_step_ms",
                                              "eager_fb_ms", "compiled_fb_ms", "compiled_loss_fb_ms", "jax_fb_ms"],
                         labels=["eager step", "fused step", "fused, batch on device", "jax.jit step",
                                 "eager fwd+bwd", "compiled fwd+bwd", "compiled, loss inside", "jax fwd+bwd"], log=True,
                         title="tpudist (torch) vs the same model by hand in JAX, ms per step")
    else:
        _plots.time_bars(rows, png, keys=["eager_ms", "compiled_ms", "eager_train_ms", "fused_train_ms"],
                         labels=["eager fwd+bwd", "compiled fwd+bwd", "eager step", "fused step"],
                         group=["model", "batch"], log=True, title="eager torch vs tpudist (ms per step)")
    return str(png)


def _hf_models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], dict]]]:
    """name -> (build the model, make a batch of n): the `--hf` models."""
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
        return {"pixel_values": torch.randn(n, 3, 64, 64, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}

    def tokens(n: int) -> dict:
        g = torch.Generator().manual_seed(0)
        return {"input_ids": torch.randint(0, 30522, (n, 128), generator=g),
                "attention_mask": torch.ones(n, 128, dtype=torch.int64),
                "labels": torch.randint(0, 2, (n,), generator=g)}

    return {"resnet18": (resnet18, images), "bert_tiny": (bert_tiny, tokens)}


def bench_hf(name: str, batch: int, steps: int, repeats: int, warmup: int, device: str = "cpu") -> dict[str, Any]:
    """One row for a `--hf` model: forward+backward of its own loss, eager vs `tpudist.compile`,
    and a whole SGD-momentum step, eager vs `compile_train_step(model, None, opt)`."""
    build, make_batch = _hf_models()[name]
    torch.manual_seed(0)
    model = build().to(device).train()
    data = {k: v.to(device) for k, v in make_batch(batch).items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    eager, train_model, fused_model = (copy.deepcopy(model) for _ in range(3))
    compiled = tpudist.compile(model)
    opt = _sgd(train_model.parameters())
    fused = tpudist.compile_train_step(fused_model, None, _sgd(fused_model.parameters()))

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

    eager_step, compiled_step = fb(eager, list(eager.parameters())), fb(compiled, list(model.parameters()))
    start = time.perf_counter()
    compiled_step()
    sync()
    first_call = time.perf_counter() - start
    eager_step()  # the same train-mode forward on both sides: BatchNorm's running statistics agree
    eager.eval()
    model.eval()
    with torch.no_grad():  # in eval mode: no dropout, so the two sides must agree
        loss_eager, loss_compiled = float(eager(**data).loss), float(compiled(**data).loss)
    eager.train()
    model.train()
    if not abs(loss_eager - loss_compiled) <= 1e-3 * max(1.0, abs(loss_eager)):
        raise AssertionError(f"{name} batch {batch}: compiled loss {loss_compiled} != eager {loss_eager}")
    start = time.perf_counter()
    float(fused(data))
    fused_first = time.perf_counter() - start
    for _ in range(warmup):
        for step in (eager_step, compiled_step, eager_train, lambda: fused(data)):
            step()
    times = _time_interleaved({"eager": eager_step, "compiled": compiled_step, "eager_train": eager_train,
                               "fused": lambda: fused(data)}, steps, repeats, sync)
    return {
        "model": name, "batch": batch, "device": device, "params": sum(p.numel() for p in model.parameters()),
        "eager_ms": times["eager"] * 1e3, "compiled_ms": times["compiled"] * 1e3,
        "speedup": times["eager"] / times["compiled"],
        "eager_train_ms": times["eager_train"] * 1e3, "fused_train_ms": times["fused"] * 1e3,
        "fused_speedup": times["eager_train"] / times["fused"],
        "loss_eager": loss_eager, "loss_compiled": loss_compiled,
        "first_call_s": first_call, "fused_first_call_s": fused_first,
        "capture_s": compiled.stats.capture_seconds,
    }


def _data_parallel_worker(index: int, models: list[str], batches: list[int], steps: int, repeats: int,
                          warmup: int, threads: int) -> list[dict[str, Any]]:
    """In each of the spawned processes: torch DDP (gloo) and the fused step on the same model,
    optimizer and per-process half of the global batch, timed alternately."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="env://")   # tpudist's contract sets MASTER_ADDR/PORT
    count = dist.get_world_size()
    rows = []
    try:
        for name in models:
            for global_batch in batches:
                ref = REFERENCES[name]
                torch.manual_seed(0)
                model = ref.build("bench")
                ddp = DistributedDataParallel(copy.deepcopy(model))
                inputs, target = ref.batch("bench", global_batch // count, torch.Generator().manual_seed(index))
                ddp_step = _eager_train_step(ddp, ref.loss, _sgd(ddp.parameters()), inputs, target)
                fused = tpudist.compile_train_step(model, ref.loss, _sgd(model.parameters()))
                batch_tuple = (*inputs, target)

                def fused_step() -> Any:
                    return fused(batch_tuple)

                start = time.perf_counter()
                fused_step()
                first = time.perf_counter() - start
                for _ in range(warmup):
                    ddp_step()
                    fused_step()
                times = _time_interleaved({"ddp": ddp_step, "fused": fused_step}, steps, repeats)
                rows.append({"model": name, "global_batch": global_batch, "processes": count,
                             "ddp_ms": times["ddp"] * 1e3, "fused_ms": times["fused"] * 1e3,
                             "speedup": times["ddp"] / times["fused"], "fused_first_call_s": first})
    finally:
        dist.destroy_process_group()
    return rows


def bench_fused_data_parallel(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fused data-parallel step (`tpudist.compile_train_step`: forward, backward, in-graph
    gradient all-reduce and SGD-momentum update in one XLA executable) vs torch DDP (gloo, eager
    forward/backward/step) over `--dp-processes` local processes, each on its share of the
    global batch. Rank 0's timings (the processes run in lockstep)."""
    results = tpudist.spawn(_data_parallel_worker, nprocs=args.dp_processes, cpu_devices=1, timeout=3600,
                            args=(args.models, args.batches, args.steps, args.repeats, args.warmup,
                                  args.dp_torch_threads))
    return results[0]


def _table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'model':<14}{'batch':>6}{'params':>10}{'eager fb ms':>12}{'compiled fb':>12}{'ratio':>8}"
              f"{'eager step':>12}{'fused step':>12}{'ratio':>8}")
    lines = ["forward+backward (fb) and whole SGD-momentum train step, ms; ratio = eager / compiled "
             "(>1: compiled faster)", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['batch']:>6}{r['params']:>10}{r['eager_ms']:>12.2f}"
                     f"{r['compiled_ms']:>12.2f}{r['speedup']:>7.2f}x{r['eager_train_ms']:>12.2f}"
                     f"{r['fused_train_ms']:>12.2f}{r['fused_speedup']:>7.2f}x")
    return "\n".join(lines)


def _dp_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'model':<14}{'global batch':>13}{'procs':>6}{'DDP ms':>10}{'fused ms':>10}{'ratio':>8}"
    lines = ["data parallel: torch DDP (gloo) vs the fused XLA step, ms per step; ratio = DDP / fused",
             header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['global_batch']:>13}{r['processes']:>6}{r['ddp_ms']:>10.2f}"
                     f"{r['fused_ms']:>10.2f}{r['speedup']:>7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(REFERENCES), choices=sorted(REFERENCES))
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per side; the best is kept")
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads for the eager side "
                        "(default: torch's own choice; with other processes on the cores, fewer threads can be faster)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dp-processes", type=int, default=2, help="processes of the DDP vs fused comparison")
    parser.add_argument("--dp-torch-threads", type=int, default=1,
                        help="torch threads per DDP process (default 1: the processes share the cores)")
    parser.add_argument("--vs-jax", nargs="*", choices=["mlp_small", "mlp_wide", "transformer", "resnet18"],
                        help="compare with hand-written JAX (all models when given without names)")
    parser.add_argument("--hf", nargs="*", choices=["resnet18", "bert_tiny"],
                        help="also the transformers models (all when given without names), at --hf-batches")
    parser.add_argument("--hf-batches", nargs="+", type=int, default=[4], help="batches of the --hf models")
    parser.add_argument("--skip-single", action="store_true", help="only the data-parallel comparison")
    parser.add_argument("--skip-dp", action="store_true", help="only the single-process comparison")
    parser.add_argument("--device", default="cpu", help="torch device of the single-process comparison: "
                        "cpu, or cuda (XLA then runs on JAX's GPU backend)")
    parser.add_argument("--no-tf32", action="store_true", help="with --device cuda: full float32 matmuls on "
                        "both sides (default: TF32 on both, XLA's own default on GPU)")
    parser.add_argument("--cpu-sync-dispatch", action="store_true",
                        help="XLA:CPU runs every executable on the calling thread "
                        "(jax_cpu_enable_async_dispatch=False, process-wide, so on every side): no hand-off to "
                        "XLA's threads per call, and no host running ahead of the device (docs/torch.md)")
    parser.add_argument("--keep-going", action="store_true",
                        help="record a model that fails as an error row and go on with the next")
    parser.add_argument("--json", type=Path, help="also write the results here (rewritten after every row)")
    args = parser.parse_args(argv)

    if args.cpu_sync_dispatch:
        import jax
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():  # the setting is read once, when the CPU client is made
            parser.error("--cpu-sync-dispatch: JAX's backends are already initialized in this process")
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cuda = args.device.startswith("cuda")
    if cuda:
        import jax
        tf32 = not args.no_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
    load_before = list(os.getloadavg())
    rows: list[dict[str, Any]] = []
    jax_rows: list[dict[str, Any]] = []
    dp_rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        import jax
        result = {
            "benchmark": "torch training step: tpudist.compile / compile_train_step (XLA) vs eager torch and DDP",
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()],
                        "torch_device": torch.cuda.get_device_name() if cuda else "cpu",
                        "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
            "settings": {"steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
                         "device": args.device, "tf32": cuda and not args.no_tf32,
                         "cpu_async_dispatch": not args.cpu_sync_dispatch},
            "rows": rows, "errors": errors, "vs_jax": jax_rows,
            "fused_data_parallel": dp_rows,
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
        return result

    hf = [] if args.hf is None else (args.hf or ["resnet18", "bert_tiny"])
    jobs = [(name, batch, bench_model) for name in ([] if args.skip_single else args.models) for batch in args.batches]
    jobs += [(name, batch, bench_hf) for name in hf for batch in args.hf_batches]
    for name, batch, bench in jobs:
        try:
            rows.append(bench(name, batch, args.steps, args.repeats, args.warmup, args.device))
        except Exception as error:
            if not args.keep_going:
                raise
            import traceback
            errors.append({"model": name, "batch": batch, "error": traceback.format_exc()})
            print(f"  {name} batch {batch}: FAILED {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            continue
        finally:
            report()
        print(f"  {name} batch {batch}: eager {rows[-1]['eager_ms']:.2f} ms, "
              f"compiled {rows[-1]['compiled_ms']:.2f} ms, eager train step {rows[-1]['eager_train_ms']:.2f} ms, "
              f"fused {rows[-1]['fused_train_ms']:.2f} ms", file=sys.stderr, flush=True)
    for name in ([] if args.vs_jax is None else (args.vs_jax or ["mlp_small", "mlp_wide", "transformer", "resnet18"])):
        jax_rows.append(bench_vs_jax(name, args.steps, args.repeats, args.warmup))
        report()
        print(f"  {name}: fused/jax {jax_rows[-1]['fused_over_jax']:.2f}x, compiled/jax "
              f"{jax_rows[-1]['compiled_over_jax']:.2f}x", file=sys.stderr, flush=True)
    if not args.skip_dp and not cuda:
        dp_rows.extend(bench_fused_data_parallel(args))
    result = report()
    if rows:
        print(_table(rows))
    if jax_rows:
        print(_jax_table(jax_rows))
        print(_floor_table(jax_rows))
        print(_host_table(jax_rows))
    if args.json and (rows or jax_rows):
        print(f"picture: {_draw(args.json, rows, jax_rows)}", file=sys.stderr)
    if dp_rows:
        print(_dp_table(dp_rows))
    print(json.dumps(result, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
