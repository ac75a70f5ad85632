"""bench_torch.py's `vs-jax` mode: tpudist's torch steps against the engine's own floor, the same
models written by hand in JAX (scripts/_jax_reference.py), and against torch's own share of a
compiled call (scripts/_autograd_floor.py), every side in one process, interleaved run by run in
an order shuffled each round (scripts/_bench.py).

Sides: the whole train step (eager torch; the fused step given torch tensors, and given its batch
already on the devices as the JAX side's is; jax.jit, parameters and optimizer state donated) and
forward+backward (eager; `tpudist.compile(model)` with the loss in eager torch; `tpudist.compile`
of model and loss together; jax.jit of value_and_grad). The floor: the same caller code around a
module that computes nothing, alone ('floor'), right after JAX's forward+backward waited for
('reach': the least a bridge that keeps torch's autograd driving can cost) and around JAX's forward
and backward as two executables ('reach split': the least for a bridge whose caller computes the
loss in torch between them). The calling thread's and the whole process's CPU per step too.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import jax
import numpy as np
import torch
import torch.nn.functional as F

import _bench
import _jax_reference as jr
import _plots
import tpudist
from _autograd_floor import Floor

WithLoss = _bench.example("torch_models").WithLoss


def bench_vs_jax(name: str, args: Any) -> dict[str, Any]:
    """One `vs-jax` row: the train step and forward+backward of `name`, eager torch vs tpudist vs
    the same model written by hand in JAX."""
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
             # as it will be (caches cold: docs/bench/HISTORY.md)
             "reach_fb": (after_jax(fb(floor, floor_params)), nothing),
             "reach_loss_fb": (after_jax(fb(floor_loss, floor_params, loss_inside=True)), nothing),
             # the loss in torch between forward and backward splits them: JAX's split, each half
             # waited for where the bridge's runs, inside the floor
             "reach_split_fb": (fb(floor_split, floor_params), nothing),
             "jax_fb_split": (lambda: (jax_forward(), jax_backward()), nothing),
             "jax_fb": (lambda: forward_backward(fb_params, fb_state, x, y), ready),
             # the same, waited for call by call as a torch caller must (its loss is a real tensor)
             "jax_fb_waited": (lambda: jax.block_until_ready(forward_backward(fb_params, fb_state, x, y)), nothing)}
    first = {side: _bench.first_call(lambda: wait(step()))[1]  # compiles happen here, timed apart
             for side, (step, wait) in sides.items()}
    times = _bench.interleave({side: _bench.Side(step, wait) for side, (step, wait) in sides.items()},
                              rounds=args.repeats, steps=args.steps, warmup=args.warmup,
                              settle_s=_bench.SETTLE_S, shuffle=True)
    ms = {side: t.median * 1e3 for side, t in times.items()}
    thread_us = {side: t.thread_median * 1e6 for side, t in times.items()}
    process_ms = {side: t.process_median * 1e3 for side, t in times.items()}
    row = {"model": name, "batch": ref.batch_size, "params": sum(p.numel() for p in model.parameters()),
           **{f"{side}_ms": t for side, t in ms.items()},
           # the host's work per step: the calling thread's CPU (launching, staging, torch's share)
           # and the process's (with XLA's threads running the executables)
           **{f"{side}_thread_cpu_us": t for side, t in thread_us.items()},
           **{f"{side}_cpu_ms": t for side, t in process_ms.items()},
           "fused_over_jax": ms["fused_step"] / ms["jax_step"],
           "fused_device_over_jax": ms["fused_step_device"] / ms["jax_step"],
           "eager_over_jax": ms["eager_step"] / ms["jax_step"],
           "compiled_over_jax": ms["compiled_fb"] / ms["jax_fb"],
           "compiled_loss_over_jax": ms["compiled_loss_fb"] / ms["jax_fb"],
           "compiled_loss_over_jax_waited": ms["compiled_loss_fb"] / ms["jax_fb_waited"],
           # the least a bridge that keeps torch's autograd driving can reach: the executable waited
           # for (the caller needs its result before going on), then torch's share
           "floor_over_jax": ms["floor_fb"] / ms["jax_fb"],
           "floor_loss_over_jax": ms["floor_loss_fb"] / ms["jax_fb"],
           "reachable_over_jax": ms["reach_fb"] / ms["jax_fb"],
           "reachable_loss_over_jax": ms["reach_loss_fb"] / ms["jax_fb"],
           "reachable_split_over_jax": ms["reach_split_fb"] / ms["jax_fb"],
           "compiled_over_reachable_split": ms["compiled_fb"] / ms["reach_split_fb"],
           "eager_fb_over_jax": ms["eager_fb"] / ms["jax_fb"],
           "fused_cpu_over_jax": process_ms["fused_step"] / process_ms["jax_step"],
           "fused_device_cpu_over_jax": process_ms["fused_step_device"] / process_ms["jax_step"],
           "first_call_s": first, "torch_threads": torch.get_num_threads()}
    assert fused.stats.compiles == 1 and compiled.stats.compiles == 1 and with_loss.stats.compiles == 1, \
        (fused.stats, compiled.stats, with_loss.stats)
    return row


JAX_COLUMNS = [
    ("model", "model", "s"), ("batch", "batch", "d"), ("eager step", "eager_step_ms", ".3f"),
    ("fused", "fused_step_ms", ".3f"), ("on dev", "fused_step_device_ms", ".3f"), ("jax", "jax_step_ms", ".3f"),
    ("fused/jax", "fused_over_jax", "x"), ("dev/jax", "fused_device_over_jax", "x"),
    ("eager fb", "eager_fb_ms", ".3f"), ("compiled", "compiled_fb_ms", ".3f"), ("+loss", "compiled_loss_fb_ms", ".3f"),
    ("jax fb", "jax_fb_ms", ".3f"), ("waited", "jax_fb_waited_ms", ".3f"), ("compiled/jax", "compiled_over_jax", "x"),
    ("+loss/jax", "compiled_loss_over_jax", "x"), ("+loss/waited", "compiled_loss_over_jax_waited", "x")]
JAX_TITLE = ("vs the same model written by hand in JAX (jax.jit, donated), ms per step (median); "
             "ratio = tpudist / JAX (<= 1: at the engine's floor); 'on dev': the fused step given its batch "
             "on the devices (a DeviceBatch), as the JAX side's is; 'waited': JAX's fwd+bwd waited for "
             "call by call, as a compiled torch module's caller must")
FLOOR_COLUMNS = [
    ("model", "model", "s"), ("jax fb", "jax_fb_ms", ".3f"), ("waited", "jax_fb_waited_ms", ".3f"),
    ("split", "jax_fb_split_ms", ".3f"), ("floor", "floor_fb_ms", ".3f"), ("+loss", "floor_loss_fb_ms", ".3f"),
    ("reach", "reach_fb_ms", ".3f"), ("+loss", "reach_loss_fb_ms", ".3f"),
    ("reach split", "reach_split_fb_ms", ".3f"), ("reach/jax", "reachable_over_jax", "x"),
    ("+loss", "reachable_loss_over_jax", "x"), ("split", "reachable_split_over_jax", "x"),
    ("compiled/jax", "compiled_over_jax", "x"), ("+loss", "compiled_loss_over_jax", "x"),
    ("compiled/reach split", "compiled_over_reachable_split", "x")]
FLOOR_TITLE = ("compiled forward+backward against torch's own share, ms (median): 'floor' is the same caller code "
               "around a module that computes nothing (scripts/_autograd_floor.py), loss in torch / '+loss' inside "
               "the module; 'reach' is JAX's forward+backward waited for, then that floor: the least a bridge that "
               "keeps torch's autograd driving can reach; 'split' is JAX's forward and backward as two executables "
               "and 'reach split' the floor running them, each waited for where a bridge that computes the loss in "
               "torch between them runs its own")
HOST_COLUMNS = [
    ("model", "model", "s"), ("thread: fused", "fused_step_thread_cpu_us", ".0f"),
    ("on dev", "fused_step_device_thread_cpu_us", ".0f"), ("jax", "jax_step_thread_cpu_us", ".0f"),
    ("compiled+loss", "compiled_loss_fb_thread_cpu_us", ".0f"), ("reach+loss", "reach_loss_fb_thread_cpu_us", ".0f"),
    ("process: fused", "fused_step_cpu_ms", ".3f"), ("on dev", "fused_step_device_cpu_ms", ".3f"),
    ("jax", "jax_step_cpu_ms", ".3f"), ("fused/jax", "fused_cpu_over_jax", "x"),
    ("dev/jax", "fused_device_cpu_over_jax", "x")]
HOST_TITLE = ("CPU per step (median): 'thread' is the calling thread's, in us (the host's work: launching, "
              "staging a batch, torch's share), 'process' all threads', in ms (with XLA's running the "
              "executables); less moved than wall time by other tenants of a shared machine")


def tables(rows: list[dict[str, Any]]) -> str:
    """The three vs-jax tables: times, torch's own share, CPU per step."""
    return "\n".join(_bench.table(rows, columns, title) for columns, title in
                     ((JAX_COLUMNS, JAX_TITLE), (FLOOR_COLUMNS, FLOOR_TITLE), (HOST_COLUMNS, HOST_TITLE)))


def draw(rows: list[dict[str, Any]], png: Any) -> Any:
    return _plots.time_bars(rows, png, keys=["eager_step_ms", "fused_step_ms", "fused_step_device_ms", "jax_step_ms",
                                             "eager_fb_ms", "compiled_fb_ms", "compiled_loss_fb_ms", "jax_fb_ms"],
                            labels=["eager step", "fused step", "fused, batch on device", "jax.jit step",
                                    "eager fwd+bwd", "compiled fwd+bwd", "compiled, loss inside", "jax fwd+bwd"],
                            log=True, title="tpudist (torch) vs the same model by hand in JAX, ms per step")
