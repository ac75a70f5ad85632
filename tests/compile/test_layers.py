"""Repeated layers lowered as one `lax.scan` (tpudist/compile/_torch/lowering/_layers.py).

A run of identical layers is compiled once as a scan body; these tests hold that it computes what
eager torch computes (values, gradients, a fused training step, per-layer dropout), that runs that do
not fit (a layer reading two layers back, layers that differ) are lowered node by node and still
correct, and that `TPUDIST_SCAN_LAYERS` is read as documented.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import tpudist
from tpudist.compile._torch.lowering import _layers
from tpudist.compile._torch.lowering._capture import capture


class Block(torch.nn.Module):
    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.tanh(self.fc(self.norm(x))) + bias


class Stack(torch.nn.Module):
    """`depth` blocks in a ModuleList; `skip` feeds each block the output of the block two back too."""

    def __init__(self, depth: int, width: int = 8, skip: bool = False, scales: list[float] | None = None):
        super().__init__()
        self.embed = torch.nn.Linear(4, width)
        self.layers = torch.nn.ModuleList(Block(width, s) for s in (scales or [1.0] * depth))
        self.head = torch.nn.Linear(width, 3)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        bias = h.mean(dim=0, keepdim=True)  # one value every layer reads (shared)
        before = h
        for layer in self.layers:
            h, before = layer(h + before if self.skip else h, bias), h
        return self.head(h)


def _scans(model: torch.nn.Module, *args) -> list[int]:
    captured = capture(model, args, {})
    calls = [n for n in captured.graph.nodes if n.op == "call_function"]
    return [len(scan.layers) for scan in _layers.find_scans(calls, 2)]


def _forward_and_grads(model: torch.nn.Module, compiled, x: torch.Tensor):
    out = compiled(x)
    out.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _assert_matches_eager(model: torch.nn.Module, x: torch.Tensor) -> None:
    eager = copy.deepcopy(model)
    got, got_grads = _forward_and_grads(model, tpudist.compile(model), x)
    want, want_grads = _forward_and_grads(eager, eager, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_identical_layers_scan_and_match_eager():
    torch.manual_seed(0)
    model, x = Stack(depth=5), torch.randn(6, 4)
    assert _scans(model, x) == [5]
    _assert_matches_eager(model, x)


def test_layers_that_differ_or_read_two_back_are_lowered_one_by_one_and_match_eager():
    torch.manual_seed(1)
    x = torch.randn(6, 4)
    skipping = Stack(depth=4, skip=True)  # block i reads block i-2's output: not a carry
    assert _scans(skipping, x) == []
    _assert_matches_eager(skipping, x)
    # blocks 0-1 and 3-4 are identical, block 2 scales by another constant: two runs of two
    mixed = Stack(depth=5, scales=[1.0, 1.0, 0.5, 1.0, 1.0])
    assert _scans(mixed, x) == [2, 2]
    _assert_matches_eager(mixed, x)


def _trains_as_torch_optim(model: torch.nn.Module, steps: int, before_step=lambda i, m: None) -> None:
    """`steps` fused AdamW steps equal torch.optim's on a copy (`before_step(i, m)` runs on both)."""
    eager = copy.deepcopy(model)
    loss_fn = torch.nn.functional.cross_entropy
    step = tpudist.compile_train_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-2))
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for i in range(steps):
        for m in (model, eager):
            before_step(i, m)
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        loss = step((x, y))
        eager_opt.zero_grad()
        want = loss_fn(eager(x), y)
        want.backward()
        eager_opt.step()
        torch.testing.assert_close(float(loss), want.item(), rtol=1e-5, atol=1e-6)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_a_fused_training_step_over_scanned_layers_matches_torch_optim():
    torch.manual_seed(2)
    _trains_as_torch_optim(Stack(depth=4), 3)


def test_layers_with_their_own_adam_step_counts_train_as_torch_optim():
    """The step takes a run's weights as one stack; each layer's copy keeps its own Adam step count
    (here layer 1 was frozen for the first two steps, so its bias corrections start later), and
    weights too large for the pool (40x40) are stacked as well."""
    torch.manual_seed(4)
    _trains_as_torch_optim(Stack(depth=4, width=40), 4, lambda i, m: m.layers[1].requires_grad_(i >= 2))


class DropBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.nn.functional.dropout(torch.ones_like(x), p=0.5, training=self.training)
        return x + mask, mask


class Drops(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(DropBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        masks = []
        for layer in self.layers:
            x, mask = layer(x)
            masks.append(mask)
        return x, masks


def test_each_scanned_layer_draws_its_own_dropout_mask():
    model, x = Drops(depth=4).train(), torch.zeros(64, 64)
    assert _scans(model, x) == [4]
    out, masks = tpudist.compile(model)(x)
    for mask in masks:
        assert set(mask.unique().tolist()) <= {0.0, 2.0}  # inverted dropout at p=0.5
        assert 0.4 < float((mask > 0).float().mean()) < 0.6
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"layers {j} and {i} drew the same dropout mask"
    torch.testing.assert_close(out, sum(masks))


def test_scan_layers_setting(monkeypatch):
    torch.manual_seed(3)
    model, x = Stack(depth=3), torch.randn(6, 4)
    monkeypatch.setenv(_layers.MIN_LAYERS_ENV, "0")
    _assert_matches_eager(model, x)  # every layer on its own
    assert _layers.min_layers() == 0
    monkeypatch.setenv(_layers.MIN_LAYERS_ENV, "4")
    assert _layers.min_layers() == 4
    for bad in ("1", "many"):
        monkeypatch.setenv(_layers.MIN_LAYERS_ENV, bad)
        with pytest.raises(ValueError, match=_layers.MIN_LAYERS_ENV):
            _layers.min_layers()


def test_dynamo_graphs_scan_their_layers_too():
    """A graph dynamo hands over has no submodules; its nodes' module paths are carried through the
    capture, so its identical layers scan as in `tpudist.compile`, with eager's values and gradients."""
    from tpudist.compile._torch.module._dynamo import backend
    torch._dynamo.reset()
    handed: list = []

    def recording(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        handed.append((gm, tuple(example_inputs)))
        return compiled

    torch.manual_seed(5)
    model, x = Stack(depth=4), torch.randn(6, 4)
    eager = copy.deepcopy(model)
    got, got_grads = _forward_and_grads(model, torch.compile(model, backend=recording), x)
    want, want_grads = _forward_and_grads(eager, eager, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert [_scans(gm, *inputs) for gm, inputs in handed] == [[4]]
    torch._dynamo.reset()


EXIT_SCRIPT = """
import torch, transformers
import tpudist
tpudist.init()  # the persistent compilation cache: the later runs skip XLA's compile, not the step
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=12, n_head=2,
                                                             n_positions=32))
ids = torch.randint(0, 64, (4, 8))
tpudist.compile(model)(ids, labels=ids).loss.backward()
print("done", flush=True)
"""


def test_a_process_exits_cleanly_right_after_a_scanned_step(tmp_path):
    """XLA may drop its last hold on an imported torch tensor on its own thread as a step ends; once the
    interpreter is finalizing, that thread's GIL request used to abort the process (exit code 134,
    "terminate called without an active exception", ~1 in 10 runs of this script). The exit hook of
    tpudist's buffer import waits for XLA first."""
    pytest.importorskip("transformers")
    env = {**os.environ, "TPUDIST_CACHE_DIR": str(tmp_path / "cache")}
    for attempt in range(4):
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0 and "done" in done.stdout, (attempt, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr
