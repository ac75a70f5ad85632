"""The step cache (tpudist/compile/_torch/lowering/_capture_cache.py): a fused step whose exported graph
and step were seen before, by this process or another, compiles the stored program instead of
decomposing and tracing the graph again, and trains exactly as the first did; a changed forward
misses. Each test has a cache directory of its own (TPUDIST_CACHE_DIR, read when a step compiles)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import tpudist
from tpudist.compile._torch.lowering import _capture

transformers = pytest.importorskip("transformers")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPUDIST_STEP_CACHE", raising=False)
    return tmp_path / "tpudist-steps"


@pytest.fixture
def decompositions(monkeypatch):
    """How many decompositions to core ATen the captures ran."""
    real, calls = _capture.decompose, []

    def counted(program, table):
        calls.append(program)
        return real(program, table)

    monkeypatch.setattr(_capture, "decompose", counted)
    return calls


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    return transformers.GPT2LMHeadModel(config).train()  # dropout on: the stored step draws as the first


def _train(model, optimizer, batches, seed=1):
    """(losses, parameters after the steps, whether the step came from the cache)."""
    step = tpudist.compile_train_step(model, None, optimizer)
    torch.manual_seed(seed)
    losses = [float(step(batch)) for batch in batches]
    step.sync()
    program = next(iter(step._programs.values()))
    hit = program.stored is not None and program.stored.hit
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, hit


def _batches(n=3):
    ids = torch.randint(0, 64, (n, 4, 8), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": i, "labels": i} for i in ids]


def test_a_new_step_of_a_seen_model_trains_from_the_stored_program_exactly_as_the_first(cache, decompositions):
    base = _gpt2()
    first, second = copy.deepcopy(base), copy.deepcopy(base)
    losses, params, hit = _train(first, torch.optim.AdamW(first.parameters(), lr=1e-2), _batches())
    assert not hit and len(decompositions) == 1
    assert sorted(p.suffix for p in cache.iterdir()) == [".capture", ".step"]
    again, params_again, hit_again = _train(second, torch.optim.AdamW(second.parameters(), lr=1e-2), _batches())
    assert hit_again and len(decompositions) == 1  # the second capture stopped after torch.export
    assert again == losses  # bit for bit: the same program, the same random stream
    for name, value in params.items():
        assert torch.equal(params_again[name], value), name


def test_a_seen_graph_with_another_optimizer_decomposes_and_trains_as_without_the_cache(cache, decompositions,
                                                                                          monkeypatch):
    """The capture entry hits, the step entry (keyed by the optimizer's update too) misses: the
    deferred decomposition runs, agrees with the entry, and the step equals an uncached one."""
    base = _gpt2()
    sgd, adam, uncached = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    _train(sgd, torch.optim.SGD(sgd.parameters(), lr=0.1), _batches(1))
    losses, params, hit = _train(adam, torch.optim.Adam(adam.parameters(), lr=1e-2), _batches())
    assert not hit and len(decompositions) == 2 and len(list(cache.glob("*.step"))) == 2
    monkeypatch.setenv("TPUDIST_STEP_CACHE", "0")
    want, want_params, _ = _train(uncached, torch.optim.Adam(uncached.parameters(), lr=1e-2), _batches())
    assert losses == want
    for name, value in want_params.items():
        assert torch.equal(params[name], value), name


class _Scaled(torch.nn.Module):
    """The same parameters and shapes; `forward` differs by its activation and its scale."""

    def __init__(self, activation, scale):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.activation, self.scale = activation, scale

    def forward(self, x):
        return self.b(self.activation(self.a(x))) * self.scale


@pytest.mark.parametrize("changed", [(torch.tanh, 2.0), (torch.relu, 3.0)], ids=["activation", "constant"])
def test_a_changed_forward_with_the_same_shapes_misses_the_cache(cache, changed):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss_fn = torch.nn.functional.mse_loss
    for model, should_hit in ((_Scaled(torch.relu, 2.0), False), (_Scaled(*changed), False),
                              (_Scaled(*changed), True)):
        eager = copy.deepcopy(model)
        with torch.no_grad():
            want = float(loss_fn(eager(x), y))
        step = tpudist.compile_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
        assert float(step((x, y))) == pytest.approx(want, rel=1e-6)
        assert next(iter(step._programs.values())).stored.hit is should_hit


def test_an_unreadable_entry_is_a_miss_said_once_and_written_again(cache, caplog):
    base = _gpt2()

    def train():
        model = copy.deepcopy(base)
        return _train(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1))

    losses, _, _ = train()
    (entry,) = cache.glob("*.step")
    entry.write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="tpudist.compile"):
        again, _, hit = train()
    assert not hit and again == losses
    assert "unreadable step cache entry" in caplog.text and str(entry) in caplog.text
    assert train()[2]  # written again


class _Clamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad  # straight through: Python the exported graph does not show


def test_graphs_the_key_cannot_describe_are_not_cached_and_train_as_ever(cache):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4) * 3, torch.randn(8, 1)

    def loss_fn(out, target):
        return ((_Clamp.apply(out) - target) ** 2).mean()

    eager = copy.deepcopy(model)
    want = loss_fn(eager(x), y)
    want.backward()
    step = tpudist.compile_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    assert float(step((x, y))) == pytest.approx(float(want), rel=1e-6)
    step.sync()
    with torch.no_grad():
        assert torch.allclose(model.weight, eager.weight - 0.1 * eager.weight.grad, atol=1e-6)
    assert not cache.exists() or not any(cache.iterdir())


def test_the_cache_is_off_with_its_switch(cache, monkeypatch):
    monkeypatch.setenv("TPUDIST_STEP_CACHE", "0")
    model = _gpt2()
    _, _, hit = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1))
    assert not hit and not cache.exists()


def test_an_entry_that_disagrees_with_the_graph_it_names_is_an_error_naming_it(cache):
    """Never silently wrong: a capture entry is checked against the decomposition wherever one runs
    (here: a new optimizer, so the step itself is not stored yet)."""
    import pickle
    base = _gpt2()
    model = copy.deepcopy(base)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1))
    (entry,) = cache.glob("*.capture")
    stored_format, told = pickle.loads(entry.read_bytes())
    told["op_counts"] = {**told["op_counts"], "aten.add.Tensor": -1}  # a stand-in for a wrong entry
    entry.write_bytes(pickle.dumps((stored_format, told)))
    model = copy.deepcopy(base)
    with pytest.raises(RuntimeError, match=rf"step cache entry {entry.stem}\.capture .* op_counts=.*TPUDIST_STEP_CACHE=0"):
        _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), _batches(1))


def _data_parallel_rank():
    """Two steps of one model in each process: the first compiles it (or loads what the other process
    stored), the second must load it; both train alike."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rows = torch.Generator().manual_seed(tpudist.process_index())  # each process its own rows
    x, y = torch.randn(4, 8, generator=rows), torch.randn(4, 1, generator=rows)
    runs = []
    for _ in range(2):
        model = copy.deepcopy(base)
        step = tpudist.compile_train_step(model, torch.nn.functional.mse_loss,
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        losses = [float(step((x, y))) for _ in range(2)]
        step.sync()
        runs.append((losses, next(iter(step._programs.values())).stored.hit,
                     [p.detach().numpy().copy() for p in model.parameters()]))
    return runs


def test_the_processes_of_a_data_parallel_job_load_the_stored_step(tmp_path):
    from tpudist.testing import run_on_mesh
    ranks = run_on_mesh(_data_parallel_rank, nprocs=2, env={"TPUDIST_CACHE_DIR": str(tmp_path)}, timeout=300)
    # the first steps: whichever process stores the step first, the other may already load it
    assert not all(first[1] for first, _ in ranks) and all(second[1] for _, second in ranks)
    for (losses, _, params), (losses_again, _, params_again) in ranks:
        assert losses_again == losses  # the averaged gradients: the same collective program
        for p, q in zip(params, params_again):
            assert (p == q).all()
