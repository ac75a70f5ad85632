"""The fused torch step's state through `tpudist.checkpoint`, on 2 processes x 2 devices: a model
with a `ShardedEmbedding` (rows split over the 4 devices) and AdamW state, saved from the devices,
restored into a fresh step, trains on exactly like the original."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(tpudist.nn.ShardedEmbedding(20, 4, mode="mean"), nn.Linear(4, 2))


def _batches(rank: int) -> list:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randint(0, 20, (4, 3), generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(6)]


def _on_rank(directory: str) -> dict:
    from tpudist import checkpoint
    rank = tpudist.process_index()
    data = _batches(rank)
    model = _model()
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=0.05))
    for batch in data[:3]:
        step(batch)
    checkpoint.save(directory, 3, step.state())
    for batch in data[3:]:
        step(batch)
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    # a fresh model and step (other weights): the restored state, then the same last 3 batches
    torch.manual_seed(99)
    fresh = _model()
    again = tpudist.compile_train_step(fresh, F.cross_entropy, torch.optim.AdamW(fresh.parameters(), lr=0.05))
    saved_at, state = checkpoint.restore(directory, like=again.state())
    block = state["params"][0]  # the table's rows (the steps below take these arrays over: donated)
    local_rows, rows = sum(s.data.shape[0] for s in block.addressable_shards), block.shape[0]
    again.load_state(state)
    for batch in data[3:]:
        again(batch)
    return {"saved_at": saved_at, "straight": {k: v.numpy() for k, v in straight.items()},
            "resumed": {k: v.numpy() for k, v in fresh.state_dict().items()}, "local_rows": local_rows, "rows": rows}


def test_fused_step_state_with_a_sharded_embedding_round_trips(tmp_path):
    ranks = run_on_mesh(_on_rank, nprocs=2, cpu_devices=2, kwargs={"directory": str(tmp_path / "ckpt")}, timeout=300)
    for r in ranks:
        assert r["saved_at"] == 3
        assert r["local_rows"] * 2 == r["rows"]  # each process holds (and wrote) only its half of the rows
        for key, value in r["straight"].items():
            np.testing.assert_array_equal(r["resumed"][key], value, err_msg=key)
