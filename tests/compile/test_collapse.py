"""Identical layers decomposed once (tpudist/compile/_torch/lowering/_collapse.py).

The reference is torch's own decomposition of every layer: with the runs collapsed, the decomposed
graph must be the same graph, node for node (op, value shape and dtype, module path, wiring, random
ops in their places), for hand-written stacks, a run broken by a layer that differs, checkpointed
layers, and a `transformers` GPT-2 with dropout on. Values against eager torch are in test_layers.py
(whose stacks of 4 and 5 layers are collapsed too).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from tpudist.compile._torch.lowering import _collapse
from tpudist.compile._torch.lowering._capture import capture
from tpudist.compile._torch.lowering._captured import Slot
from tpudist.compile._torch.lowering._layers import module_paths

from test_layers import Drops, Stack

_REAL_COLLAPSE = _collapse.collapse


def _graph(captured) -> list[tuple]:
    """The graph as comparable rows: op, target, value shape/dtype, innermost module path, inputs by
    position. A constant is read by value: a layer traced once reads its first layer's constants,
    which equal its own (the call that made them is compared argument for argument)."""
    placeholders = [n for n in captured.graph.nodes if n.op == "placeholder"]
    constants = {node: ("constant", repr(captured.constants[slot.name].tolist()))
                 for node, slot in zip(placeholders, captured.inputs) if slot.kind is Slot.CONSTANT}
    position = {node: i for i, node in enumerate(n for n in captured.graph.nodes if n not in constants)}
    rows = [repr([slot for slot in captured.inputs if slot.kind is not Slot.CONSTANT]),
            repr(captured.outputs)]  # which outputs write which buffers
    for node in captured.graph.nodes:
        if node in constants:
            continue
        val = node.meta.get("val")
        value = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        paths = module_paths(node)
        rows.append((node.op, str(node.target), value, paths[-1] if paths else None,
                     tuple(constants.get(n) or position[n] for n in node.all_input_nodes)))
    return rows


def _both(monkeypatch, model: torch.nn.Module, *args) -> tuple[list, list, list]:
    """(graph with collapsing, graph without, the runs collapsed)."""
    collapsed = []
    real = _REAL_COLLAPSE

    def spy(gm):
        runs = real(gm)
        collapsed.extend(runs)
        return runs
    monkeypatch.setattr(_collapse, "collapse", spy)
    once = _graph(capture(model, args, {}))
    with monkeypatch.context() as every_layer:
        every_layer.setenv("TPUDIST_SCAN_LAYERS", "0")  # every layer traced and decomposed
        full = _graph(capture(model, args, {}))
    return once, full, collapsed


def test_collapsed_layers_decompose_to_the_graph_torch_gives_for_every_layer(monkeypatch):
    torch.manual_seed(0)
    once, full, runs = _both(monkeypatch, Stack(depth=5), torch.randn(6, 4))
    assert [run.container for run in runs] == ["traced.layers"]
    assert once == full
    # every layer's dropout mask is an output read after the run; each layer keeps its own random op
    once, full, runs = _both(monkeypatch, Drops(depth=4).train(), torch.zeros(8, 8))
    assert runs and once == full
    assert sum("dropout" in row[1] or "rand" in row[1] or "bernoulli" in row[1] for row in once) >= 4


def test_a_run_broken_by_a_layer_that_differs_collapses_only_the_identical_ones(monkeypatch):
    torch.manual_seed(1)
    model = Stack(depth=7, scales=[1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    once, full, runs = _both(monkeypatch, model, torch.randn(6, 4))
    assert sorted(run.start for run in runs) == [0, 4]
    assert once == full


class Checkpointed(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.stack = Stack(depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stack.embed(x)
        for layer in self.stack.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, h.mean(0), use_reentrant=False)
        return self.stack.head(h)


def test_checkpointed_layers_are_decomposed_one_by_one(monkeypatch):
    torch.manual_seed(2)
    once, full, runs = _both(monkeypatch, Checkpointed(depth=4), torch.randn(6, 4))
    assert runs == []
    assert once == full


class NormBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x)))


def test_layers_that_write_their_buffers_in_place_keep_every_write(monkeypatch):
    torch.manual_seed(4)
    model = torch.nn.Sequential(*(NormBlock(8) for _ in range(4))).train()  # running statistics updated
    once, full, runs = _both(monkeypatch, model, torch.randn(6, 8))
    assert once == full
    assert sum("BUFFER" in row for row in once[1].split("OutputSlot")) >= 12  # each layer's mean, var and count


class ViewBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(x)
        return y, y[:, :2]  # the second output is a view of the first


class WrittenAfter(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(ViewBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs, views = [], []
        for layer in self.layers:
            x, view = layer(x)
            outs.append(x)
            views.append(view)
        views[1].add_(1.0)  # written in place after the run: layer 1's first output changes with it
        return tuple(outs)


def test_a_layer_output_written_in_place_later_keeps_the_run_whole(monkeypatch):
    once, full, runs = _both(monkeypatch, WrittenAfter(depth=4), torch.randn(6, 8))
    assert runs == []
    assert once == full


def test_a_transformers_gpt2_decomposes_to_the_same_graph(monkeypatch):
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()  # dropout on, as trained
    ids = torch.randint(0, 64, (2, 12))

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids).loss

    once, full, runs = _both(monkeypatch, Loss(), ids)
    assert [run.container.rsplit(".", 1)[-1] for run in runs] == ["h"]
    assert once == full
