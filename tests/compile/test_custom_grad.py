"""Gradients the graph alone does not show: each construct gives eager torch's `.grad`, or an error.

Custom `autograd.Function`s (their own backward), `torch.utils.checkpoint` in both forms, grad-mode
regions and `detach` inside forward, in-place ops on views, and hooks. Each case runs the same
module eagerly and through `tpudist.compile` (and, where it trains, the fused step) and compares
every parameter's `.grad` (None where eager's is None).
"""

from __future__ import annotations

import copy

import jax
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import tpudist
from tpudist.compile import CaptureError

pytestmark = pytest.mark.filterwarnings("ignore")


class Scaled(torch.autograd.Function):
    """Forward doubles; backward scales by 3 (deliberately not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


class StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient through unchanged, clipped to |x| <= limit."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.save_for_backward(x)
        ctx.limit = limit
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= ctx.limit), None


class Mixed(torch.autograd.Function):
    """setup_context style; two outputs, a tensor kept on ctx, an integer input, an input whose
    gradient is None, and a broadcast gradient torch sums back to the input's shape."""

    @staticmethod
    def forward(x, bias, ids, frozen):
        return x * bias + frozen, (x * frozen).sum(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, ids, frozen = inputs
        ctx.save_for_backward(x, bias)
        ctx.scale = ids.float().mean() + 1
        ctx.frozen_shape = frozen.shape

    @staticmethod
    def backward(ctx, g, g_sum):
        x, bias = ctx.saved_tensors
        grad_x = g * bias * ctx.scale + g_sum[..., None]
        grad_bias = g * x  # the (rows, width) gradient of a (width,) bias: summed back by torch's engine
        return grad_x, grad_bias, None, None


class Net(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.bias = torch.nn.Parameter(torch.randn(6))
        self.body = body

    def forward(self, x):
        return self.body(self, x)


BODIES = {
    "custom backward": lambda m, x: m.b(Scaled.apply(m.a(x))).square().sum(),
    "straight-through estimator": lambda m, x: (m.b(StraightThrough.apply(m.a(x) * 3, 1.5)) ** 2).sum(),
    "setup_context, two outputs, ctx tensors": lambda m, x: (
        lambda out: (out[0] ** 2).sum() + out[1].sum())(
        Mixed.apply(m.a(x), m.bias, torch.arange(6), torch.linspace(0, 1, 6))),
    "nested: a Function inside a checkpoint": lambda m, x: checkpoint.checkpoint(
        lambda t: m.b(Scaled.apply(torch.tanh(m.a(t)))), x * 1.0 + 0 * m.bias.sum(), use_reentrant=True).sum(),
    "reentrant checkpoint": lambda m, x: checkpoint.checkpoint(
        lambda t: m.b(F.gelu(m.a(t))), m.a(x), use_reentrant=True).square().sum(),
    "non-reentrant checkpoint": lambda m, x: checkpoint.checkpoint(
        lambda t: m.b(F.gelu(m.a(t))), x, use_reentrant=False).square().sum(),
    "reentrant checkpoint, no input requires grad": lambda m, x: (
        checkpoint.checkpoint(lambda t: m.b(t), x, use_reentrant=True).sum() + m.a(x).sum()),
    "no_grad, enable_grad, set_grad_enabled, detach": lambda m, x: _grad_modes(m, x),
    "in-place ops on views of an intermediate": lambda m, x: _in_place(m, x),
}


def _grad_modes(m, x):
    h = m.a(x)
    with torch.no_grad():
        scale = h.abs().mean()
        with torch.enable_grad():
            inner = m.b(h).sum()  # enable_grad inside no_grad: differentiated, as in eager torch
    with torch.set_grad_enabled(False):
        shift = m.b(h).mean()
    return (h * scale).sum() + inner + shift + (h * h.detach()).sum()


def _in_place(m, x):
    h = m.a(x).clone()
    h[:, :2].mul_(3)             # through a view
    h.select(1, 4).add_(m.bias[0])
    torch.relu_(h)
    return m.b(h).sum()


def _grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_gradients_equal_eager_torch(name):
    model = Net(BODIES[name])
    eager = copy.deepcopy(model)
    x = torch.randn(5, 6)
    want = eager(x)
    want.backward()
    got = tpudist.compile(model)(x)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mine, theirs = _grads(model), _grads(eager)
    for key in theirs:
        assert (mine[key] is None) == (theirs[key] is None), f"{name}: .grad of {key}: {mine[key]} vs eager {theirs[key]}"
        if theirs[key] is not None:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-5, msg=f"{name}: .grad of {key}")


@pytest.mark.parametrize("name", ["custom backward", "straight-through estimator", "reentrant checkpoint"])
def test_the_fused_step_trains_with_the_same_gradients(name):
    model = Net(BODIES[name])
    eager = copy.deepcopy(model)
    make = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    step = tpudist.compile_train_step(model, lambda out, _: out, make(model.parameters()))
    optimizer = make(eager.parameters())
    for i in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        loss = step((x, torch.zeros(5)))
        optimizer.zero_grad()
        want = eager(x)
        want.backward()
        optimizer.step()
        torch.testing.assert_close(float(loss), float(want), rtol=1e-5, atol=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, eager.state_dict()[key], rtol=1e-5, atol=1e-6)


def test_checkpointed_regions_are_recomputed_in_the_backward():
    """The region becomes a jax.checkpoint (remat): its backward recomputes the region's
    intermediates from its inputs instead of keeping them, the memory trade torch's checkpoint makes."""
    from tpudist.compile._torch.lowering._capture import capture
    from tpudist.compile._torch.lowering._lower import lower
    for reentrant in (True, False):
        model = Net(lambda m, x: checkpoint.checkpoint(lambda t: m.b(F.gelu(m.a(t))), x * 1.0 + 0 * m.bias,
                                                       use_reentrant=reentrant).sum())
        captured = capture(model, (torch.randn(5, 6),), {})
        run = lower(captured)
        arrays = [jax.numpy.zeros(p.meta["val"].shape) for p in captured.graph.nodes if p.op == "placeholder"]
        jaxpr = str(jax.make_jaxpr(lambda *a: jax.grad(lambda a: run(a, None)[0].sum())(list(a)))(*arrays))
        assert "checkpoint" in jaxpr or "remat" in jaxpr, f"use_reentrant={reentrant}: no rematerialized region"


def test_transformers_gradient_checkpointing_both_forms_matches_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    batch = {"input_ids": torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    for reentrant in (True, False):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        eager = copy.deepcopy(model)
        eager(**batch).loss.backward()
        tpudist.compile(model)(**batch).loss.backward()
        for (key, mine), theirs in zip(_grads(model).items(), _grads(eager).values()):
            assert (mine is None) == (theirs is None), f"use_reentrant={reentrant} {key}"
            if theirs is not None:
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5,
                                           msg=f"use_reentrant={reentrant}: .grad of {key}")


def test_hooks_the_graph_cannot_hold_are_errors_naming_them():
    model = Net(lambda m, x: m.b(m.a(x).register_hook(lambda g: g * 10) or m.a(x)).sum())
    with pytest.raises(CaptureError, match=r"Tensor.register_hook\(.*<lambda>.*test_custom_grad.py"):
        tpudist.compile(model)(torch.randn(5, 6))
    model = Net(BODIES["custom backward"])
    model.a.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(CaptureError, match=r"module 'a' \(Linear\) has a backward hook"):
        tpudist.compile(model)(torch.randn(5, 6))


def test_parameter_hooks_run_under_compile_and_are_an_error_in_the_fused_step():
    model = Net(BODIES["custom backward"])
    eager = copy.deepcopy(model)
    for m in (model, eager):
        m.a.weight.register_hook(lambda g: g * 0.5)
    x = torch.randn(5, 6)
    tpudist.compile(model)(x).backward()
    eager(x).backward()
    torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)  # torch's engine ran the hook
    step = tpudist.compile_train_step(model, lambda out, _: out, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CaptureError, match="parameter 'a.weight' has a gradient hook"):
        step((x, torch.zeros(5)))


def test_in_place_updates_of_leaves_fail_as_in_eager_torch():
    def leaf(m, x):
        m.a.weight.mul_(2)
        return m.a(x).sum()

    def view_of_leaf(m, x):
        m.a.weight[0].add_(1)
        return m.a(x).sum()

    for body in (leaf, view_of_leaf):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            Net(body)(torch.randn(5, 6))
        with pytest.raises(CaptureError, match="leaf Variable that requires grad"):
            tpudist.compile(Net(body))(torch.randn(5, 6))

    def under_no_grad(m, x):  # allowed in eager torch; a compiled module does not write parameters back
        with torch.no_grad():
            m.a.weight.mul_(0.5)
        return m.a(x).sum()

    with pytest.raises(CaptureError, match="modifies parameter 'a.weight' in place"):
        tpudist.compile(Net(under_no_grad))(torch.randn(5, 6))


def test_an_input_modified_in_place_while_it_requires_grad_is_an_error():
    model = Net(lambda m, x: m.a(x.mul_(2)).sum())
    x = torch.randn(5, 6, requires_grad=True) * 1  # a non-leaf: eager torch differentiates through the mul_
    with pytest.raises(RuntimeError, match=r"modifies its input args_0 in place while it requires grad"):
        tpudist.compile(model)(x)
    x = torch.randn(5, 6)
    before = x.clone()
    want = Net(lambda m, x: m.a(x.mul_(2)).sum())(before.clone())
    got = tpudist.compile(model)(x)  # no grad required: the new value is written back, as in eager torch
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, before * 2)


def test_unsupported_custom_functions_name_the_class_and_the_fix():
    class Dirty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.mul_(2)

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class ReadsParameter(torch.autograd.Function):
        weight = torch.nn.Parameter(torch.ones(6))

        @staticmethod
        def forward(ctx, x):
            return x * ReadsParameter.weight

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(CaptureError, match=r"Function .*Dirty marks an input dirty"):
        tpudist.compile(Net(lambda m, x: Dirty.apply(m.a(x).clone()).sum()))(torch.randn(5, 6))
    with pytest.raises(CaptureError, match=r"Function .*ReadsParameter reads a tensor that requires grad \(\(6,\) torch.float32\) without"):
        tpudist.compile(Net(lambda m, x: ReadsParameter.apply(m.a(x)).sum()))(torch.randn(5, 6))


def test_parameters_only_unused_outputs_reach_get_no_gradient_as_in_eager():
    """`.grad` stays None where eager torch leaves it None: an output the loss does not use, a branch
    under no_grad. An optimizer steps a zero gradient (momentum, weight decay) but skips None."""
    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            with torch.no_grad():
                gate = self.c(x).sigmoid()
            return self.a(x) * gate, self.b(x)

    model = Heads()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 6)
    eager(x)[0].sum().backward()
    tpudist.compile(model)(x)[0].sum().backward()
    for (key, mine), theirs in zip(_grads(model).items(), _grads(eager).values()):
        assert (mine is None) == (theirs is None), f".grad of {key}: {mine} vs eager {theirs}"
        if theirs is not None:
            torch.testing.assert_close(mine, theirs)
    assert model.b.weight.grad is None and model.c.weight.grad is None
