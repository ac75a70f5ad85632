"""`tpudist.explain`: the verdict and each section on small models, no XLA compile, the model's state
and the RNG left as they were, and the user's dynamo-compiled models kept."""

from __future__ import annotations

import jax
import pytest
import torch

import tpudist


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.5)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.norm(self.up(x)))))


class InputBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # BRANCH ON INPUT
            return self.lin(x) * 2
        return self.lin(x)


class ActivationBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # BRANCH ON ACTIVATION
            return h * 2
        return h


class Indices(torch.nn.Module):
    def forward(self, x):
        return x + torch.triu_indices(8, 8).sum()


class NoLowering(torch.nn.Module):
    """aten.tril_indices and aten.triu_indices have no lowering (a tpudist gap this test relies on)."""

    def __init__(self):
        super().__init__()
        self.block = Indices()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.block(x)) + torch.tril_indices(8, 8).sum() + torch.tril_indices(4, 4).sum()


def _line(marker: str) -> str:
    with open(__file__) as source:
        number = next(i for i, text in enumerate(source, 1) if marker in text and "_line(" not in text)
    return f"{__file__}:{number}"


@pytest.fixture
def compiles():
    """The XLA compiles that happen in the test (jax's own compile event)."""
    seen = []

    def listener(event, duration, **kwargs):
        if "backend_compile" in event:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def test_mlp_compiles_as_one_graph_with_no_xla_compile(compiles):
    report = tpudist.explain(MLP(), torch.randn(4, 8))
    assert report.verdict.startswith("compiles as one graph")
    assert report.captured and report.capture_error is None
    assert report.nodes > 0 and "aten.addmm.default" in report.ops
    assert (report.parameters, report.buffers) == (6, 3)
    assert report.missing == {} and report.guards == [] and report.scans == []
    assert (report.graphs, report.breaks) == (1, [])
    text = str(report)
    assert text.splitlines()[0] == f"tpudist.explain: {report.verdict}"
    assert "Ops with no lowering: none" in text and "1 graph(s), 0 graph break(s)" in text
    assert compiles == []


def test_input_branch_is_a_guard_and_a_graph_break_at_the_users_line():
    report = tpudist.explain(InputBranch(), torch.randn(4, 8).abs())
    line = _line("BRANCH ON INPUT")
    assert report.captured and report.guards and all(line in guard for guard in report.guards)
    assert report.graphs == 2 and [b.where for b in report.breaks] == [line]
    assert report.breaks[0].reason
    assert "torch.compile(backend='tpudist') would cut it into 2 graphs" in report.verdict
    assert f"break at {line}" in str(report)


def test_activation_branch_needs_dynamo():
    report = tpudist.explain(ActivationBranch(), torch.randn(4, 8))
    assert not report.captured and "depends on parameter or buffer 'lin.weight'" in report.capture_error
    assert report.verdict.startswith("needs torch.compile(backend='tpudist'): 1 graph break")
    assert [b.where for b in report.breaks] == [_line("BRANCH ON ACTIVATION")]


def test_every_op_with_no_lowering_is_listed_with_its_modules():
    report = tpudist.explain(NoLowering(), torch.randn(4, 8))
    assert report.verdict == "cannot compile: 2 ops have no lowering"
    assert report.missing == {
        "aten.triu_indices.default": ["module 'block' (Indices)"],
        "aten.tril_indices.default": ["the top-level forward (NoLowering)"] * 2,
    }
    text = str(report)
    assert "aten.tril_indices.default x2: in the top-level forward (NoLowering)" in text
    assert "aten.triu_indices.default x1: in module 'block' (Indices)" in text
    with pytest.raises(tpudist.UnsupportedOpError, match="triu_indices.*Also unsupported in this module: "
                                                         "aten.tril_indices"):
        tpudist.compile(NoLowering())(torch.randn(4, 8))  # capture's own check: unchanged


def test_gpt2_layers_are_named_as_one_scan():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=2, n_positions=32, n_layer=3)
    model = transformers.GPT2LMHeadModel(config)
    report = tpudist.explain(model, torch.randint(0, 64, (2, 16)))
    assert report.verdict.startswith("compiles as one graph")
    assert report.scans == [("transformer.h", 3)]
    assert "scan: transformer.h: 3 layers as one lax.scan" in str(report)


def test_state_modes_and_rng_are_unchanged():
    model = MLP()  # training: BatchNorm's statistics would move, dropout would draw
    model.up.eval()  # mixed modes: each module's own flag comes back
    x = torch.randn(4, 8)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    tensors = {name: value for name, value in [*model.named_parameters(), *model.named_buffers()]}
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    tpudist.explain(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(value is tensors[name] for name, value in [*model.named_parameters(), *model.named_buffers()])
    assert all(p.grad is None for p in model.parameters())


def test_the_users_compiled_models_are_kept():
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    compiled = torch.compile(MLP().eval(), backend=backend)
    x = torch.randn(4, 8).abs()
    compiled(x)
    for _ in range(10):  # more than dynamo's recompile limit (8) of InputBranch.forward
        report = tpudist.explain(InputBranch(), x)
        assert report.graphs == 2
    compiled(x)
    assert len(compiled_graphs) == 1  # not dropped by a reset: no recompile
    torch._dynamo.reset()
