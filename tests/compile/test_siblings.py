"""A run of identical layers traced once (tpudist/compile/_torch/lowering/_siblings.py).

The reference is torch.export tracing every layer (TPUDIST_SCAN_LAYERS=0): with the later layers
standing in, the decomposed graph must be the same graph node for node (test_collapse's `_graph`).
Where a layer cannot stand in (its calls differ, it keeps a value that is read after it, it writes to
its input, its output feeds nothing), the capture must still give that graph, by tracing every layer.
"""

from __future__ import annotations

import pytest
import torch

from tpudist.compile._torch._custom_ops import LAYER
from tpudist.compile._torch.lowering import _collapse
from tpudist.compile._torch.lowering._capture import capture

from test_collapse import _graph

_REAL_COLLAPSE = _collapse.collapse
RAN: list[torch.nn.Module] = []


def _both(monkeypatch, model: torch.nn.Module, *args) -> tuple[list, list, list[int]]:
    """(graph with layers traced once where they can be, graph with every layer traced, the layer
    indices that stood in for torch.export)."""
    stood_in: list[int] = []

    def spy(gm):
        stood_in.extend(n.args[1] for n in gm.graph.nodes if n.target is LAYER)
        return _REAL_COLLAPSE(gm)
    monkeypatch.setattr(_collapse, "collapse", spy)
    once = _graph(capture(model, args, {}))
    with monkeypatch.context() as every_layer:
        every_layer.setenv("TPUDIST_SCAN_LAYERS", "0")
        full = _graph(capture(model, args, {}))
    return once, full, stood_in


class Block(torch.nn.Module):
    def __init__(self, width: int, scale: float = 1.0, keep: bool = False, in_place: bool = False,
                 draw: bool = False):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.scale, self.keep, self.in_place, self.draw = scale, keep, in_place, draw

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        RAN.append(self)  # (a side effect torch.export does not undo, as a cache's update)
        h = torch.nn.functional.dropout(torch.tanh(self.fc(x) * self.scale + bias), 0.2, self.training)
        if self.keep:
            self.kept = h * 2.0  # a value read after the run, not through the layer's output
        if self.draw:
            self.kept = torch.rand(h.shape[-1]) * 2.0  # the same, computed from no input: each layer its own draw
        if self.in_place:
            x.add_(1.0)
        return x + h


class Model(torch.nn.Module):
    def __init__(self, depth: int = 5, chained: bool = True, read_kept: bool = False, **block):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(Block(8, **block) for _ in range(depth))
        self.chained, self.read_kept = chained, read_kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        bias = h.mean(dim=0)
        outs = []
        for layer in self.layers:
            outs.append(layer(h, bias))
            h = outs[-1] if self.chained else h
        out = h if self.chained else outs[-1]  # (unchained: the first layer's output feeds nothing)
        return out + self.layers[2].kept if self.read_kept else out


def test_later_layers_stand_in_and_decompose_to_the_graph_of_every_layer_traced(monkeypatch):
    torch.manual_seed(0)
    model = Model(depth=5).train()  # (dropout on: each layer keeps its own random op)
    RAN.clear()
    once, full, stood_in = _both(monkeypatch, model, torch.randn(6, 4))
    assert sorted(stood_in) == [1, 2, 3, 4]
    assert once == full
    assert RAN == [*model.layers] * 2  # a layer's Python runs once per capture, in order


@pytest.mark.parametrize("case", ["differs", "keeps", "draws", "in_place", "unchained"])
def test_layers_that_cannot_stand_in_are_all_traced(monkeypatch, case):
    torch.manual_seed(1)
    model = {"differs": lambda: Model(depth=5),
             "keeps": lambda: Model(depth=4, keep=True, read_kept=True),
             "draws": lambda: Model(depth=4, draw=True, read_kept=True),
             "in_place": lambda: Model(depth=4, in_place=True),
             "unchained": lambda: Model(depth=4, chained=False)}[case]()
    if case == "differs":
        model.layers[3].scale = 0.5  # the same module, another constant in its Python
    once, full, stood_in = _both(monkeypatch, model, torch.randn(6, 4))
    assert once == full
    assert stood_in == []


def test_a_transformers_model_returning_its_cache_is_traced_whole(monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(input_ids=ids, use_cache=True)
            return out.logits, out.past_key_values.layers[3].keys  # the last layer's cache: read after it

    once, full, stood_in = _both(monkeypatch, Cached(), torch.randint(0, 64, (2, 12)))
    assert stood_in == []
    assert once == full
