"""Data-parallel torch training across processes: optimizer_step, tpudist.nn.ShardedEmbedding, fit.

Every check runs in ONE 2-process job (a module fixture; each rank returns its numbers), and each
test compares them with eager single-process torch run here, on the global batch the ranks
shared: data parallelism over 2 processes, each holding half of a batch, must train exactly like
one process on the whole batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh

N = 2
STEPS = 4
VOCAB, DIM = 7, 3   # 7 rows over 2 processes: 4 per process, the last one padding
# Ids per rank: shard edges (3 | 4), the last real row (6), repeated ids within and across ranks.
IDS = [torch.tensor([[0, 3], [4, 6], [3, 3]]), torch.tensor([[6, 6], [4, 0], [1, 5]])]
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.05)}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Linear(2, 2)  # never gets a grad: optimizer_step must skip it on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp() -> nn.Module:
    return MLP()


def global_batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def dense_table() -> torch.Tensor:
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(2))


def targets(n: int) -> torch.Tensor:
    return torch.randn(n, 1, generator=torch.Generator().manual_seed(3))


class BagModel(nn.Module):
    """An embedding bag (sharded or dense) feeding a replicated linear head."""

    def __init__(self, emb: nn.Module):
        super().__init__()
        self.emb = emb
        torch.manual_seed(4)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def fit_data() -> torch.utils.data.TensorDataset:
    x, y = global_batch(42, seed=5)   # 11 batches of 4 (the last has 2): 5 rounds of 2, one dropped
    return torch.utils.data.TensorDataset(x, y)


def numpy_params(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def on_rank() -> dict:
    rank = tpudist.process_index()
    half = slice(rank * 4, rank * 4 + 4)
    out: dict = {}

    # optimizer_step: each rank trains on its half of the global batch.
    x, y = global_batch()
    for name, make in OPTIMIZERS.items():
        model = mlp()
        opt = make(model.parameters())
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[half]), y[half]).backward()
            tpudist.optimizer_step(opt)
        out[f"dp_{name}"] = numpy_params(model)

    # ShardedEmbedding forward in every mode, on this rank's ids.
    table = dense_table()
    for mode in (None, "sum", "mean"):
        emb = tpudist.nn.ShardedEmbedding.from_dense(table, mode=mode)
        out[f"emb_{mode}"] = emb(IDS[rank]).detach().numpy()
        out[f"emb_{mode}_local"] = emb.weight.detach().numpy().copy()
    out["emb_full"] = emb.full_weight().numpy()

    # ShardedEmbedding + replicated head, trained with optimizer_step (SGD: sensitive to grad scale).
    model = BagModel(tpudist.nn.ShardedEmbedding.from_dense(table, mode="mean"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    y_bag = targets(6)[rank * 3:rank * 3 + 3]
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(IDS[rank]), y_bag).backward()
        tpudist.optimizer_step(opt)
    out["bag_table"] = model.emb.full_weight().numpy()
    out["bag_head"] = numpy_params(model.head)

    # fit: every rank sees the same loader; batch i trains on rank i % 2.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(fit_data(), batch_size=4)
    out["fit_history"] = tpudist.fit(model, loader, opt, F.mse_loss, epochs=3)
    out["fit_params"] = numpy_params(model)

    # Errors every rank raises the same way (the bad ids are only on rank 1).
    emb = tpudist.nn.ShardedEmbedding(VOCAB, DIM)
    try:
        emb(torch.tensor([1, 2]) if rank == 0 else torch.tensor([1, VOCAB]))
    except ValueError as e:
        out["bad_ids"] = str(e)
    try:
        tpudist.fit(mlp(), torch.utils.data.DataLoader(fit_data(), batch_size=4 + rank), opt, F.mse_loss)
    except ValueError as e:
        out["bad_lengths"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_mesh(on_rank, nprocs=N, timeout=240)


def assert_params_close(got: dict[str, np.ndarray], model: nn.Module) -> None:
    want = numpy_params(model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_step_tracks_single_process_training(ranks, name):
    x, y = global_batch()
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    initial = numpy_params(model)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for r in ranks:
        assert_params_close(r[f"dp_{name}"], model)
    # the check has teeth: training moved the parameters
    assert not np.allclose(ranks[0][f"dp_{name}"]["net.0.weight"], initial["net.0.weight"])


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_sharded_embedding_forward_equals_dense(ranks, mode):
    table = dense_table()
    for rank, r in enumerate(ranks):
        want = F.embedding(IDS[rank], table) if mode is None else F.embedding_bag(IDS[rank], table, mode=mode)
        np.testing.assert_allclose(r[f"emb_{mode}"], want.numpy(), rtol=1e-6, atol=1e-7)
        # each rank holds its contiguous block of rows, the last one padded with zeros
        block = torch.zeros(4, DIM)
        rows = table[rank * 4:rank * 4 + 4]
        block[:len(rows)] = rows
        np.testing.assert_array_equal(r[f"emb_{mode}_local"], block.numpy())
    np.testing.assert_array_equal(ranks[0]["emb_full"], table.numpy())


def test_sharded_embedding_trains_like_dense(ranks):
    model = BagModel(nn.EmbeddingBag.from_pretrained(dense_table(), freeze=False, mode="mean"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    ids, y = torch.cat(IDS), targets(6)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(ids), y).backward()
        opt.step()
    for r in ranks:
        np.testing.assert_allclose(r["bag_table"], model.emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert_params_close(r["bag_head"], model.head)
    # row 2 is never looked up and must not move; row 6 (shard end, repeated) must
    np.testing.assert_array_equal(ranks[0]["bag_table"][2], dense_table()[2].numpy())
    assert not np.allclose(ranks[0]["bag_table"][6], dense_table()[6].numpy())


def test_fit_equals_manual_loop(ranks):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(torch.utils.data.DataLoader(fit_data(), batch_size=4))
    losses = []
    for _ in range(3):
        epoch = []
        for k in range(5):  # round k: batches 2k (rank 0) and 2k + 1 (rank 1); batch 10 dropped
            x = torch.cat([batches[2 * k][0], batches[2 * k + 1][0]])
            y = torch.cat([batches[2 * k][1], batches[2 * k + 1][1]])
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)  # equal halves: the mean of the two ranks' losses
            loss.backward()
            opt.step()
            epoch.append(loss.item())
        losses.append(float(np.mean(epoch)))
    for r in ranks:
        assert_params_close(r["fit_params"], model)
        history = r["fit_history"]
        assert [h["epoch"] for h in history] == [1, 2, 3]
        assert [h["examples"] for h in history] == [40, 40, 40]
        np.testing.assert_allclose([h["loss"] for h in history], losses, rtol=1e-5)
        assert all(h["examples_per_s"] > 0 for h in history)
    assert losses[2] < losses[1] < losses[0]


def test_errors_name_the_rank_and_the_fix(ranks):
    for r in ranks:
        assert "rank(s) [1]" in r["bad_ids"] and f"[0, {VOCAB})" in r["bad_ids"]
        assert "[11, 9]" in r["bad_lengths"] and "same loader" in r["bad_lengths"]
