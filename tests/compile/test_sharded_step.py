"""The sharded fused step (FSDP, tensor parallelism, both on a 2-D mesh) against eager torch on the
global batch, on a CPU mesh of 2 processes x 2 devices; where each shard lives, read from the arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh

from compiled_check import FACTOR, ULPS, assert_as_accurate_as_eager, deviation_beyond_eager

GLOBAL_ROWS, SEQ, STEPS = 8, 16, 3
LAYOUTS = {  # name: (mesh axes, devices a large parameter is split over); the sharding: sharding_of
    "fsdp": ({"fsdp": -1}, 4),
    "tp": ({"data": -1, "model": 2}, 2),
    "fsdp_tp": ({"fsdp": -1, "model": 2}, 4),
}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))


def sharding_of(name: str, mlp_model: bool):
    if name == "fsdp":
        return "fsdp"
    plan = {"0": "colwise", "2": "rowwise"} if mlp_model else "llama"
    return tpudist.Sharding(fsdp=True, tp=plan) if name == "fsdp_tp" else plan


def batches(model_name: str, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if model_name == "llama":
            ids = torch.randint(0, 128, (GLOBAL_ROWS, SEQ), generator=g)
            yield {"input_ids": ids, "labels": ids}
        else:
            yield torch.randn(GLOBAL_ROWS, 64, generator=g), torch.randint(0, 8, (GLOBAL_ROWS,), generator=g)


def mine(batch):
    """This process's rows of a global batch."""
    rank, rows = jax.process_index(), GLOBAL_ROWS // jax.process_count()
    take = lambda t: t[rank * rows:(rank + 1) * rows]  # noqa: E731
    return {k: take(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(take(t) for t in batch)


def eager_loss(model, loss_fn, batch):
    return model(**batch).loss if loss_fn is None else loss_fn(model(batch[0]), batch[1])


def lm_loss(model, batch):
    """The Llama's own loss (transformers' ForCausalLMLoss: each token predicts the next, mean over
    them), computed in the model's dtype: transformers casts the logits to float32 first, which
    would make a float64 reference float32 in its loss and the loss's gradient."""
    logits = model(input_ids=batch["input_ids"]).logits
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def in_float64(batch):
    if isinstance(batch, dict):
        return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


def eager(model_name: str, dtype: torch.dtype, max_norm: float | None = None, rows: int = GLOBAL_ROWS,
          updates: int = STEPS) -> dict:
    """Eager torch on the global batches in `dtype`: the reference, in float32 and in float64.
    `rows` (the first rows of each batch) and `updates` (the steps that apply theirs) make the bugs
    the reference must tell apart."""
    model = (llama() if model_name == "llama" else mlp()).to(dtype)
    loss_fn = None if model_name == "llama" else F.cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for i, batch in enumerate(batches(model_name, STEPS)):
        batch = {k: v[:rows] for k, v in batch.items()} if isinstance(batch, dict) else tuple(t[:rows] for t in batch)
        batch = in_float64(batch) if dtype == torch.float64 else batch
        opt.zero_grad()
        loss = lm_loss(model, batch) if model_name == "llama" else eager_loss(model, loss_fn, batch)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if i < updates:
            opt.step()
        losses.append(loss.item())
    return {"losses": {"loss": np.array(losses)}, "state": {k: v.numpy() for k, v in model.state_dict().items()},
            "moments": {n: opt.state[p]["exp_avg"].numpy() for n, p in model.named_parameters()}}


def train(layout: str, model_name: str, accumulate: int = 1, max_norm: float | None = None) -> dict:
    axes, _ = LAYOUTS[layout]
    model = llama() if model_name == "llama" else mlp()
    loss_fn = None if model_name == "llama" else F.cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mesh = tpudist.mesh.make_mesh(axes)
    step = tpudist.compile_train_step(model, loss_fn, opt, mesh=mesh, sharding=sharding_of(layout, model_name == "mlp"),
                                      accumulate_steps=accumulate, max_grad_norm=max_norm)
    losses = [float(step(mine(batch))) for batch in batches(model_name, STEPS)]
    names = [name for name, _ in model.named_parameters()]
    entries = {id(e.param): i for i, e in enumerate(step.layout.entries)}
    shards = {}  # name: (global shape, [per local device: parameter shard shape, moments' shard shapes])
    for name, p in model.named_parameters():
        i = entries[id(p)]
        param, moments = step.mirror.params[i], step.mirror.states[i]
        shards[name] = (tuple(param.shape), p.numel() * 4,
                        [tuple(s.data.shape) for s in param.addressable_shards],
                        [[tuple(s.data.shape) for s in m.addressable_shards] for m in moments if m.ndim])
    state = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}  # a gather: every process reads it
    moments = {name: opt.state[p]["exp_avg"].detach().clone().numpy() for name, p in model.named_parameters()}
    return {"losses": {"loss": np.array(losses)}, "state": state, "moments": moments,
            "shards": shards, "names": names, "shardings": step.shardings(),
            "memory": (step.memory().parameters, step.memory().optimizer)}


def check_equal_to_eager(results: list[dict], model_name: str, max_norm: float | None = None) -> None:
    """Each process's losses, parameters and AdamW first moments after `STEPS` steps are as close to
    eager torch in float64 as eager torch in float32 is (compiled_check.assert_as_accurate_as_eager):
    a tolerance from float32's own error on this computation, not a fixed one."""
    want, exact = eager(model_name, torch.float32, max_norm), eager(model_name, torch.float64, max_norm)
    for result in results:
        for part in ("losses", "state", "moments"):
            assert_as_accurate_as_eager(result[part], want[part], exact[part])


def test_the_rule_against_eager_fails_a_missing_all_reduce_or_a_skipped_update():
    """check_equal_to_eager's allowance scales with float32 rounding, so it stays far below what a
    real bug moves: each process stepping on its own half of the batch (no gradient all-reduce), or
    the last update skipped, each fails it on the Llama even with an allowance 10x as large."""
    want, exact = eager("llama", torch.float32), eager("llama", torch.float64)
    half_batch, skipped = eager("llama", torch.float32, rows=GLOBAL_ROWS // 2), eager("llama", torch.float32,
                                                                                      updates=STEPS - 1)
    for bug in (half_batch, skipped):
        with pytest.raises(AssertionError, match="less accurate than eager"):
            assert_as_accurate_as_eager(bug["state"], want["state"], exact["state"], factor=10 * FACTOR,
                                        ulps=10 * ULPS)


def check_split(result: dict, over: int) -> None:
    """Every parameter of 16 KiB or more, and each of its moments, is held 1/over per device."""
    large = 0
    for name, (shape, nbytes, param, moments) in result["shards"].items():
        if nbytes < 16 << 10 or name.endswith("norm.weight"):
            continue
        large += 1
        for per_device in [param, *moments]:
            for local in per_device:
                assert np.prod(local) * over == np.prod(shape), (name, shape, local, result["shardings"][name])
    assert large >= 3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_llama_trains_as_eager_torch_on_the_global_batch(layout):
    results = run_on_mesh(train, nprocs=2, cpu_devices=2, kwargs={"layout": layout, "model_name": "llama"},
                          timeout=600)
    check_equal_to_eager(results, "llama")
    for result in results:
        check_split(result, LAYOUTS[layout][1])
    assert results[0]["memory"] != results[1]["memory"]  # each process reports its own devices


def test_sharded_mlp_with_accumulation_and_clipping_trains_as_eager():
    results = run_on_mesh(train, nprocs=2, cpu_devices=2, timeout=600,
                          kwargs={"layout": "fsdp_tp", "model_name": "mlp", "accumulate": 2, "max_norm": 0.5})
    check_equal_to_eager(results, "mlp", max_norm=0.5)
    for result in results:
        assert result["shardings"]["0.weight"] == P("model", "fsdp")
        assert result["shardings"]["2.weight"] == P("fsdp", "model")


def save_then_restore(directory: str, axes: dict, sharding, save_at: int | None) -> dict:
    """Trains the MLP `STEPS` steps; saves after `save_at` of them, or restores the saved state first
    and trains on from there (save_at None)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = tpudist.compile_train_step(model, F.cross_entropy, opt, mesh=tpudist.mesh.make_mesh(axes),
                                      sharding=sharding)
    data = list(batches("mlp", STEPS))
    start = 0
    if save_at is None:
        start, state = tpudist.checkpoint.restore(directory, like=step.state())
        step.load_state(state)
        layouts = {n: a.sharding.spec for n, a in zip(step.shardings(), step.mirror.params)}
    for i in range(start, STEPS if save_at is None else save_at):
        step(mine(data[i]))
    if save_at is not None:
        tpudist.checkpoint.save(directory, save_at, step.state())
        return {}
    return {"state": {k: v.numpy() for k, v in model.state_dict().items()}, "layouts": layouts}


@pytest.mark.parametrize("target", ["fsdp2", "tp"])
def test_a_checkpoint_saved_under_fsdp_restores_into_another_mesh_and_trains_on(tmp_path, target):
    run_on_mesh(save_then_restore, nprocs=2, cpu_devices=2, timeout=300,
                kwargs={"directory": str(tmp_path), "axes": {"fsdp": -1}, "sharding": "fsdp", "save_at": 1})
    if target == "fsdp2":  # 2 processes of one device each: each shard twice the rows
        kwargs, devices = {"axes": {"fsdp": -1}, "sharding": tpudist.Sharding(fsdp=True, min_bytes=0)}, 1
    else:
        kwargs, devices = {"axes": {"data": -1, "model": 2}, "sharding": {"0": "colwise", "2": "rowwise"}}, 2
    resumed = run_on_mesh(save_then_restore, nprocs=2, cpu_devices=devices, timeout=300,
                          kwargs={"directory": str(tmp_path), "save_at": None, **kwargs})
    # the uninterrupted run: eager torch on the global batches
    want, exact = eager("mlp", torch.float32)["state"], eager("mlp", torch.float64)["state"]
    for result in resumed:
        assert_as_accurate_as_eager(result["state"], want, exact)
        assert result["layouts"]["0.weight"] == (P("fsdp") if target == "fsdp2" else P("model"))


def plan_errors() -> dict:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    errors = {}
    cases = {
        "pattern": ({"fsdp": -1}, tpudist.Sharding(tp={"*.q_proj": "colwise"})),
        "axis": ({"fsdp": -1}, {"0.weight": P("model", None)}),
        "divisible": ({"data": -1, "model": 2}, {"4.bias": P("model")}),
        "no_fsdp_axis": ({"data": -1}, "fsdp"),
        "no_sharding": ({"data": 2, "model": 2}, None),
        "preset": ({"data": -1}, "bert-xl"),
        "style": ({"data": -1, "model": 2}, {"1": "colwise"}),
    }
    for name, (axes, sharding) in cases.items():
        odd = nn.Sequential(*list(mlp())[:4], nn.Linear(64, 5)) if name == "divisible" else model  # 5 rows over 2
        try:
            tpudist.compile_train_step(odd, F.cross_entropy, torch.optim.AdamW(odd.parameters()),
                                       mesh=tpudist.mesh.make_mesh(axes), sharding=sharding)
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    with torch.device("meta"):
        on_meta = mlp()
    try:
        tpudist.compile_train_step(on_meta, F.cross_entropy, torch.optim.AdamW(on_meta.parameters()))
    except ValueError as e:
        errors["meta_without_sharding"] = str(e)
    try:  # "model" across the two processes: both would hold the same rows of the batch
        tpudist.compile_train_step(model, F.cross_entropy, opt, mesh=tpudist.mesh.make_mesh({"model": 4, "data": 1}),
                                   sharding={"0": "colwise"})
    except ValueError as e:
        errors["model_across_processes"] = str(e)
    return errors


def test_a_plan_that_cannot_apply_is_an_error_naming_what_and_the_fix():
    errors = run_on_mesh(plan_errors, nprocs=2, cpu_devices=2, timeout=300)[0]
    assert "'*.q_proj' matches no module" in errors["pattern"] and "0.weight" in errors["pattern"]
    assert "axis 'model'" in errors["axis"] and "0.weight" in errors["axis"]
    assert "dim 0 of parameter 4.bias (size 5)" in errors["divisible"] and "2 devices" in errors["divisible"]
    assert "make_mesh({'fsdp': -1})" in errors["no_fsdp_axis"]
    assert "needs sharding=" in errors["no_sharding"]
    assert "'bert-xl'" in errors["preset"] and "llama" in errors["preset"]
    assert "GELU" in errors["style"] and "PartitionSpec" in errors["style"]
    assert "meta device" in errors["meta_without_sharding"] and "sharding=" in errors["meta_without_sharding"]
    assert "processes [0, 1]" in errors["model_across_processes"] and "'model' inside" in errors["model_across_processes"]


def dropout_steps() -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.5), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = tpudist.compile_train_step(model, F.cross_entropy, opt, mesh=tpudist.mesh.make_mesh({"fsdp": -1}),
                                      sharding="fsdp")
    batch = next(batches("mlp", 1))
    losses = [float(step(mine(batch))) for _ in range(3)]
    model.eval()
    losses.append(float(step(mine(batch))))
    with torch.no_grad():
        losses.append(F.cross_entropy(model(batch[0]), batch[1]).item())
    return losses


def test_dropout_draws_new_masks_each_sharded_step():
    """lr=0: the parameters stay; each training step's loss differs (new masks), eval mode equals eager."""
    for losses in run_on_mesh(dropout_steps, nprocs=2, cpu_devices=2, timeout=300):
        assert len(set(losses[:3])) == 3
        assert losses[3] == pytest.approx(losses[4], rel=1e-5)


def from_meta() -> dict:
    """A Llama built on the meta device: initialised into its shards, never whole on the host."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = tpudist.compile_train_step(model, None, opt, mesh=tpudist.mesh.make_mesh({"fsdp": -1}), sharding="fsdp")
    host_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    count = len(list(model.parameters()))
    shards = {n: [s.data.shape for s in a.addressable_shards] for n, a in zip(step.shardings(), step.mirror.params)}
    initial = {k: v.clone() for k, v in model.state_dict().items()}  # a door: gathered from the devices
    reference, exact = LlamaForCausalLM(config), LlamaForCausalLM(config).double()
    reference.load_state_dict(initial)
    exact.load_state_dict(initial)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    exact_opt = torch.optim.AdamW(exact.parameters(), lr=3e-3, weight_decay=0.1)
    on_cpu = LlamaForCausalLM(config)  # the same values, built on the CPU, through the same sharded step
    on_cpu.load_state_dict(initial)
    cpu_step = tpudist.compile_train_step(on_cpu, None, torch.optim.AdamW(on_cpu.parameters(), lr=3e-3, weight_decay=0.1),
                                          mesh=tpudist.mesh.make_mesh({"fsdp": -1}), sharding="fsdp")
    losses, ref_losses, exact_losses = [], [], []
    for batch in batches("llama", STEPS):
        losses.append(float(step(mine(batch))))
        cpu_step(mine(batch))
        for m, o, out in ((reference, ref_opt, ref_losses), (exact, exact_opt, exact_losses)):
            o.zero_grad()
            loss = lm_loss(m, batch)
            loss.backward()
            o.step()
            out.append(loss.item())
    state = model.state_dict()
    reference = on_cpu
    return {"host_bytes": host_bytes, "count": count, "shards": shards, "losses": losses, "ref_losses": ref_losses,
            "exact_losses": exact_losses,
            "initial_std": initial["model.layers.0.mlp.up_proj.weight"].std().item(),
            "norm": initial["model.norm.weight"].tolist(),
            "error": max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "errors": {k: (state[k] - v).abs().max().item() for k, v in reference.state_dict().items()}}


def test_a_model_built_on_the_meta_device_is_initialised_into_its_shards():
    results = run_on_mesh(from_meta, nprocs=2, cpu_devices=2, timeout=600)
    for r in results:
        assert r["host_bytes"] == 4 * r["count"]  # one element per parameter on the host until a door reads them
        assert r["shards"]["model.layers.0.mlp.up_proj.weight"] == [(32, 64)] * 2  # (128, 64) over 4 devices
        assert r["initial_std"] == pytest.approx(0.02, rel=0.2)  # the model's own init (initializer_range)
        assert r["norm"] == [1.0] * 64
        why = deviation_beyond_eager(r["losses"], r["ref_losses"], r["exact_losses"])  # against eager torch
        assert why is None, f"losses: {why}"
        assert r["error"] < 1e-6, r["errors"]  # against the model built on the CPU
    assert results[0]["norm"] == results[1]["norm"] and results[0]["initial_std"] == results[1]["initial_std"]
