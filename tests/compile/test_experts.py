"""Expert parallelism: a `transformers` Mixtral (stacked experts, top-2 routing, the load-balancing
loss) on meshes with an "expert" axis, trained by the fused step against eager torch on the global
batch (2 processes x 2 devices, and one process of 4) and served through `tpudist.compile`; where
each expert's weights live, read from the arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpudist
from tpudist.testing import run_on_mesh

from compiled_check import assert_as_accurate_as_eager

GLOBAL_ROWS, SEQ, STEPS, EXPERTS, VOCAB = 8, 8, 3, 4, 64


def mixtral(experts_implementation: str | None = None) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(experts_implementation=experts_implementation, vocab_size=VOCAB, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                           max_position_embeddings=32, num_local_experts=EXPERTS, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.02)
    return MixtralForCausalLM(config)


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=g)
        yield {"input_ids": ids, "labels": ids}


def mine(batch: dict) -> dict:
    """This process's rows of a global batch."""
    rank, rows = jax.process_index(), GLOBAL_ROWS // jax.process_count()
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def eager(dtype: torch.dtype) -> dict:
    """Eager torch on the global batches; the loss is the model's (next-token cross entropy plus the
    router's load-balancing loss), computed in `dtype` (transformers' own casts logits to float32).
    In float64 the experts run as transformers' "eager" loop (its grouped_mm takes no float64)."""
    model = mixtral("eager" if dtype == torch.float64 else None).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for batch in batches():
        opt.zero_grad()
        out = model(input_ids=batch["input_ids"])
        targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": {"loss": np.array(losses)}, "state": {k: v.numpy() for k, v in model.state_dict().items()}}


def train(axes: dict) -> dict:
    model = mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mesh = tpudist.mesh.make_mesh(axes)
    sharding = tpudist.Sharding(fsdp="fsdp" in axes, tp="experts")
    step = tpudist.compile_train_step(model, None, opt, mesh=mesh, sharding=sharding)
    losses = [float(step(mine(b))) for b in batches()]
    entries = {id(e.param): i for i, e in enumerate(step.layout.entries)}
    def blocks(p: torch.nn.Parameter) -> list[tuple[int, ...]]:
        return [tuple(s.data.shape) for s in step.mirror.params[entries[id(p)]].addressable_shards]
    shards = {name: (tuple(p.shape), blocks(p)) for name, p in model.named_parameters() if ".experts." in name}
    state = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    hlo = next(iter(step._programs.values())).executable.as_text()
    return {"losses": {"loss": np.array(losses)}, "state": state, "shards": shards,
            "all_to_all": hlo.count("all-to-all("), "shardings": step.shardings()}


@pytest.fixture(scope="module")
def expert_parallel() -> list[dict]:
    return run_on_mesh(train, nprocs=2, cpu_devices=2, timeout=600, kwargs={"axes": {"fsdp": -1, "expert": 2}})


def test_mixtral_under_expert_parallel_x_fsdp_trains_as_eager_torch(expert_parallel):
    want, exact = eager(torch.float32), eager(torch.float64)
    for result in expert_parallel:
        for part in ("losses", "state"):
            assert_as_accurate_as_eager(result[part], want[part], exact[part])


def in_one_process() -> dict:
    """The single-process cases, on one process of 4 devices (one start-up for all of them)."""
    return {"data_x_expert": train({"data": 2, "expert": 2}), "served": served(), "unsupported": unsupported_experts()}


@pytest.fixture(scope="module")
def one_process() -> dict:
    return run_on_mesh(in_one_process, nprocs=1, cpu_devices=4, timeout=900)[0]


def test_expert_parallel_beside_data_parallel_trains_as_eager_torch(one_process):
    result = one_process["data_x_expert"]
    want, exact = eager(torch.float32), eager(torch.float64)
    for part in ("losses", "state"):
        assert_as_accurate_as_eager(result[part], want[part], exact[part])
    for name, (shape, local) in result["shards"].items():
        assert all(block[0] == EXPERTS // 2 and block[1:] == shape[1:] for block in local), (name, local)


def test_each_device_holds_its_experts_only_and_tokens_travel_by_all_to_all(expert_parallel):
    for result in expert_parallel:
        assert len(result["shards"]) == 4, result["shards"]  # gate_up_proj, down_proj in 2 layers
        for name, (shape, local) in result["shards"].items():
            assert shape[0] == EXPERTS
            for block in local:  # half the experts, and FSDP's half of each
                assert block[0] == EXPERTS // 2 and np.prod(block) * 4 == np.prod(shape), (name, shape, local)
        assert result["shardings"]["model.layers.0.mlp.experts.gate_up_proj"][0] == "expert"
        assert result["all_to_all"] >= 4  # there and back, forward and backward


def save_then_restore(directory: str, axes: dict, sharding, save_at: int | None) -> dict:
    """Trains `STEPS` steps; saves after `save_at` of them, or restores the saved state into this
    layout first and trains on from there (save_at None)."""
    model = mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = tpudist.compile_train_step(model, None, opt, mesh=tpudist.mesh.make_mesh(axes), sharding=sharding)
    data, start = list(batches()), 0
    if save_at is None:
        start, state = tpudist.checkpoint.restore(directory, like=step.state())
        step.load_state(state)
    for batch in data[start:save_at]:
        step(mine(batch))
    if save_at is not None:
        tpudist.checkpoint.save(directory, save_at, step.state())
        return {}
    return {"state": {k: v.detach().clone().numpy() for k, v in model.state_dict().items()},
            "layout": step.shardings()["model.layers.0.mlp.experts.gate_up_proj"]}


def test_a_checkpoint_saved_under_expert_parallel_restores_as_plain_fsdp_and_trains_on(tmp_path):
    run_on_mesh(save_then_restore, nprocs=2, cpu_devices=2, timeout=600,
                kwargs={"directory": str(tmp_path), "axes": {"fsdp": -1, "expert": 2},
                        "sharding": tpudist.Sharding(fsdp=True, tp="experts"), "save_at": 1})
    resumed = run_on_mesh(save_then_restore, nprocs=2, cpu_devices=2, timeout=600,
                          kwargs={"directory": str(tmp_path), "axes": {"fsdp": -1}, "sharding": "fsdp",
                                  "save_at": None})
    want, exact = eager(torch.float32)["state"], eager(torch.float64)["state"]  # the uninterrupted run
    for result in resumed:
        assert_as_accurate_as_eager(result["state"], want, exact)
        assert "expert" not in tuple(result["layout"]), result["layout"]


def served() -> dict:
    model = mixtral().eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        tpudist.parallelize(model, tpudist.mesh.make_mesh({"expert": 2, "data": 2}), "experts")
        compiled = tpudist.compile(model)
        got = compiled(input_ids=ids).logits
    texts = [c.as_text() for c in compiled.last_program._executables.laid_out._compiled.values()]
    return {"error": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "all_to_all": [t.count("all-to-all(") for t in texts]}


def test_a_model_laid_out_over_an_expert_axis_serves_through_tpudist_compile(one_process):
    result = one_process["served"]
    assert result["error"] <= 1e-5 * result["scale"], result
    assert result["all_to_all"] and all(n >= 2 for n in result["all_to_all"]), result


def unsupported_experts() -> str:
    model = mixtral()
    model.model.layers[1].mlp.experts.has_bias = True  # a flag of transformers' experts the op does not compute
    step = tpudist.compile_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                      mesh=tpudist.mesh.make_mesh({"data": -1, "expert": 2}), sharding="experts")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(NotImplementedError) as info:
        step({"input_ids": ids, "labels": ids})
    return str(info.value)


def test_experts_the_op_cannot_compute_exactly_are_an_error_naming_them(one_process):
    message = one_process["unsupported"]
    assert "model.layers.1.mlp.experts" in message and "has_bias=True" in message, message
    assert "without an 'expert' mesh axis" in message, message
