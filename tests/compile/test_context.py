"""Context parallelism in the fused step: a `transformers` Llama with its sequence split over a
"context" mesh axis (a padded batch, causal attention), against eager torch on the global batch;
what one device's program holds, read from the compiled step."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpudist
from tpudist.testing import run_on_mesh

from compiled_check import assert_as_accurate_as_eager

GLOBAL_ROWS, SEQ, STEPS, VOCAB = 4, 32, 3, 96


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def batches(seq: int = SEQ, padded: bool = True):
    """Right-padded rows: the padding masked out of attention and of the loss; or rows without
    padding (transformers then passes attention its causal mask)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_ROWS, seq), generator=g)
        if not padded:
            yield {"input_ids": ids, "labels": ids}
            continue
        mask = torch.ones_like(ids)
        mask[0, -5:] = 0
        mask[2, -11:] = 0
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def eager(dtype: torch.dtype, padded: bool = True) -> dict:
    """Eager torch on the global batches, the loss computed in `dtype` (transformers' own loss casts
    the logits to float32)."""
    model = llama().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for batch in batches(padded=padded):
        opt.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": {"loss": np.array(losses)}, "state": {k: v.numpy() for k, v in model.state_dict().items()}}


def train(axes: dict, seq: int = SEQ, padded: bool = True) -> dict:
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = tpudist.compile_train_step(model, None, opt, mesh=tpudist.mesh.make_mesh(axes), sharding="fsdp")
    rank, rows = jax.process_index(), GLOBAL_ROWS // jax.process_count()
    losses = [float(step({k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()})) for b in batches(seq, padded)]
    hlo = next(iter(step._programs.values())).executable.as_text()
    return {"losses": {"loss": np.array(losses)}, "state": {k: v.detach().clone().numpy()
                                                            for k, v in model.state_dict().items()},
            "shapes": sorted(set(re.findall(r"f32\[([0-9,]+)\]", hlo)))}


def test_llama_with_its_sequence_split_over_processes_trains_as_eager_torch():
    results = run_on_mesh(train, nprocs=2, cpu_devices=2, timeout=600, kwargs={"axes": {"fsdp": -1, "context": 2}})
    want, exact = eager(torch.float32), eager(torch.float64)
    for result in results:
        for part in ("losses", "state"):
            assert_as_accurate_as_eager(result[part], want[part], exact[part])


def test_a_sequence_split_four_ways_trains_as_eager_and_no_device_holds_a_whole_sequence():
    result = run_on_mesh(train, nprocs=1, cpu_devices=4, timeout=600,
                         kwargs={"axes": {"fsdp": 1, "context": 4}, "padded": False})[0]
    want, exact = eager(torch.float32, padded=False), eager(torch.float64, padded=False)
    for part in ("losses", "state"):
        assert_as_accurate_as_eager(result[part], want[part], exact[part])
    shapes = [tuple(map(int, s.split(","))) for s in result["shapes"]]
    scores = [s for s in shapes if len(s) >= 4 and s[-1] == SEQ and s[-2] in (SEQ, SEQ // 4)]
    assert scores and all(s[-2] == SEQ // 4 for s in scores), scores  # each device: its queries x every key
    assert (GLOBAL_ROWS, SEQ // 4, 128) in shapes, shapes  # the MLP on a quarter of the sequence


class Decoder(torch.nn.Module):
    """A decoder written as a torch user writes one: attention told `is_causal=True`, no mask."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "qkv": torch.nn.Linear(width, 3 * width), "out": torch.nn.Linear(width, width),
            "mlp": torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, width))}) for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            q, k, v = block["qkv"](x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["out"](attended.transpose(1, 2).flatten(2))
            x = x + block["mlp"](x)
        return self.head(x)


def decoder_steps(dtype: torch.dtype, axes: dict | None) -> dict:
    model = Decoder().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = lambda logits, ids: F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # noqa: E731
    step = None if axes is None else tpudist.compile_train_step(model, loss_fn, opt, sharding=tpudist.Sharding(),
                                                               mesh=tpudist.mesh.make_mesh(axes))
    losses = []
    for batch in batches(padded=False):
        ids = batch["input_ids"]
        if step is not None:
            losses.append(float(step((ids, ids))))
            continue
        opt.zero_grad()
        loss = loss_fn(model(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": {"loss": np.array(losses)}, "state": {k: v.detach().clone().numpy()
                                                            for k, v in model.state_dict().items()}}


def test_causal_attention_without_a_mask_split_four_ways_trains_as_eager():
    got = run_on_mesh(decoder_steps, nprocs=1, cpu_devices=4, timeout=600,
                      kwargs={"dtype": torch.float32, "axes": {"context": 4}})[0]
    want, exact = decoder_steps(torch.float32, None), decoder_steps(torch.float64, None)
    for part in ("losses", "state"):
        assert_as_accurate_as_eager(got[part], want[part], exact[part])


def test_a_sequence_the_context_axis_does_not_divide_is_an_error_naming_it():
    with pytest.raises(AssertionError, match=r"shape \(4, 30\): pad its sequence to a multiple of 4"):
        run_on_mesh(train, nprocs=1, cpu_devices=4, timeout=300, kwargs={"axes": {"fsdp": 1, "context": 4}, "seq": 30})
