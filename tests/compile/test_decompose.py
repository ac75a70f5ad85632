"""The capture's decomposition to core ATen gives the graph torch's own `run_decompositions` gives.

tpudist skips torch's per-call setup of that decomposition (`lowering/_decompose.py`: it patches
only the CompositeImplicitAutograd ops whose treatment differs from the dispatcher's own). The
reference is torch itself: every decomposition a real capture makes below is also run through
`ExportedProgram.run_decompositions` with the same table, and the two graphs (code and signature)
must be equal, on models, on OpInfo samples of composite ops, and after a new composite op is
registered (which torch then keeps whole, as tpudist must).
"""

from __future__ import annotations

import copy

import pytest
import torch

import tpudist
from tpudist.compile import UnsupportedOpError
from tpudist.compile._torch.lowering import _capture, _decompose

from compiled_check import assert_as_accurate_as_eager


@pytest.fixture
def compared(monkeypatch):
    """Every decomposition a capture makes, checked against run_decompositions; the check count."""
    fast, calls = _decompose.decompose, []

    def both(program, table=None):
        got = fast(program, table)
        want = program.run_decompositions(_decompose.decompositions() if table is None else table)
        assert got.graph_module.code == want.graph_module.code, (
            f"the decomposed graph differs from run_decompositions':\n{got.graph_module.code}\n---\n"
            f"{want.graph_module.code}")
        assert str(got.graph_signature) == str(want.graph_signature)
        calls.append(got)
        return got

    monkeypatch.setattr(_capture, "decompose", both)
    return calls


class Composite(torch.nn.Module):
    """Modules whose ops are composite (CompositeImplicitAutograd) in ATen, and some kept whole."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.group = torch.nn.GroupNorm(2, 4)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.bag = torch.nn.EmbeddingBag(10, 8, mode="mean")

    def forward(self, x, image, ids):
        h = torch.nn.functional.gelu(self.norm(self.linear(x)), approximate="tanh")
        h = torch.nn.functional.dropout(h, 0.0, training=True)
        h, _ = self.attention(h, h, h, need_weights=False)
        h, _ = self.lstm(torch.nn.functional.pad(h, (0, 0, 1, 0)))
        up = torch.nn.functional.interpolate(self.group(self.conv(image)), scale_factor=2, mode="nearest")
        pooled = torch.nn.functional.adaptive_avg_pool2d(up, 1).flatten(1)
        mixed = torch.einsum("bsd,bd->bs", h, self.bag(ids)) + pooled.sum(-1, keepdim=True)
        return torch.nn.functional.cross_entropy(mixed, torch.zeros(len(mixed), dtype=torch.long)), h.std(1)


@pytest.mark.filterwarnings("ignore:The tensor attributes")  # torch.export on nn.LSTM's weight list
def test_a_model_of_composite_ops_decomposes_as_torch_does(compared):
    torch.manual_seed(0)
    model = Composite()
    args = (torch.randn(2, 5, 8), torch.randn(2, 4, 6, 6), torch.randint(0, 10, (2, 3)))
    loss, spread = tpudist.compile(model)(*args)
    eager = dict(zip(("loss", "spread"), model(*args)))
    exact = dict(zip(("loss", "spread"), copy.deepcopy(model).double()(args[0].double(), args[1].double(), args[2])))
    assert_as_accurate_as_eager({"loss": loss, "spread": spread}, eager, exact)
    assert compared


@pytest.mark.parametrize("name", ["gpt2", "bert", "segformer"])
def test_transformers_models_decompose_as_torch_does(compared, name):
    """The module path's capture (SegFormer's decode head: a `matmul` that folds into `mm` only when
    decomposed as torch decomposes it)."""
    pytest.importorskip("transformers")
    import test_zoo as zoo
    model = zoo.build(name)
    batch = zoo.make_batch(zoo.ZOO[name].kind, 1)
    _capture.capture(model, (), batch)
    assert len(compared) == 1


# OpInfos of composite ATen ops (decomposed by their own CIA kernel, kept whole, or decomposed by
# tpudist's own rule), their first samples through the OpInfo harness
COMPOSITE_OPINFOS = [
    "nn.functional.linear", "einsum", "matmul", "flatten", "nn.functional.pad.constant",
    "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.instance_norm",
    "nn.functional.pixel_shuffle", "nn.functional.unfold", "nn.functional.cosine_similarity",
    "nn.functional.pairwise_distance", "tensordot", "kron", "nn.functional.cross_entropy",
    "nn.functional.interpolate.nearest", "nn.functional.interpolate.bilinear", "stft",
    "nn.functional.pad.circular",
    "nn.functional.silu", "nn.functional.mish", "norm", "cdist", "take_along_dim", "std_mean",
]


@pytest.mark.parametrize("name", COMPOSITE_OPINFOS)
def test_opinfo_samples_of_composite_ops_decompose_as_torch_does(compared, name):
    pytest.importorskip("expecttest")
    import opinfo_harness as harness
    ops = harness.opinfos()
    if name not in ops:
        pytest.skip(f"torch {torch.__version__} has no OpInfo {name}")
    outcome = harness.check(ops[name])
    assert not any(harness.is_wrong(v) for v in outcome.values()), outcome
    assert compared or all(not v.startswith("pass") for v in outcome.values()), outcome


def test_a_composite_op_registered_later_is_kept_whole_as_torch_keeps_it(compared):
    """A new functional op with only a CompositeImplicitAutograd kernel, defined after earlier
    captures: torch keeps it whole in the decomposed graph; so does the capture (here it then has no
    lowering, and says so)."""
    tpudist.compile(torch.nn.Linear(3, 3))(torch.randn(2, 3))  # the table sorted before the op exists
    library = torch.library.Library("tpudist_test_late", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")

    class Late(torch.nn.Module):
        def forward(self, x):
            return torch.ops.tpudist_test_late.twice(x) + 1

    with pytest.raises(UnsupportedOpError, match="tpudist_test_late.twice"):
        tpudist.compile(Late())(torch.randn(2, 3))
    assert len(compared) == 2
