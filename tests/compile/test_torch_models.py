"""Reference models through `tpudist.compile`, trained side by side with an eager copy.

The compiled model and an eager deep copy see the same batches and optimizers: losses, every
parameter's gradient, the parameters after each torch.optim step and BatchNorm's running
statistics must agree within fp32 tolerance, and a steady loop must compile once.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import tpudist
from tpudist.compile._torch import CaptureError, UnsupportedOpError, supported_ops


def _load_reference_models():
    path = Path(__file__).resolve().parents[2] / "examples" / "torch_models.py"
    spec = importlib.util.spec_from_file_location("torch_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("torch_models", module)  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


torch_models = _load_reference_models()
REFERENCES = torch_models.REFERENCES
TOL = dict(rtol=1e-4, atol=1e-5)
# torch.export's own deprecation noise, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def _assert_same(name, got, want, **tol):
    torch.testing.assert_close(got, want, **(tol or TOL), msg=lambda m: f"{name}: {m}")


def _key_bias_mask(name, param, model):
    """Entries to compare after Adam steps. The key projection's bias of self-attention has an
    identically zero gradient (softmax is invariant to a per-query constant), so both sides hold
    only rounding noise (~1e-10) there, which Adam normalizes into +-lr steps of arbitrary sign.
    Those entries do not affect any output; the outputs are still compared at every step."""
    mask = torch.ones_like(param, dtype=torch.bool)
    if name.endswith("self_attn.in_proj_bias"):
        dim = param.shape[0] // 3
        mask[dim:2 * dim] = False
    return mask


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_training_matches_eager(name):
    ref = REFERENCES[name]
    torch.manual_seed(0)
    model = ref.build("test")
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    gen = torch.Generator().manual_seed(1)
    # three SGD-with-momentum steps, then three Adam steps, on the same compiled module
    phases = [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)), (torch.optim.Adam, dict(lr=0.01))]
    steps = 0
    for optim, kwargs in phases:
        opt, eager_opt = optim(model.parameters(), **kwargs), optim(eager.parameters(), **kwargs)
        for _ in range(3):
            inputs, target = ref.batch("test", 8, gen)
            out, eager_out = cm(*inputs), eager(*inputs)
            _assert_same(f"{name} output", out, eager_out)
            loss, eager_loss = ref.loss(out, target), ref.loss(eager_out, target)
            loss.backward()
            eager_loss.backward()
            for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
                assert p.grad is not None, f"{pname} got no gradient"
                _assert_same(f"{name} grad {pname}", p.grad, q.grad)
            opt.step()
            eager_opt.step()
            opt.zero_grad()
            eager_opt.zero_grad()
            for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
                mask = _key_bias_mask(pname, p, model) if optim is torch.optim.Adam else slice(None)
                _assert_same(f"{name} param {pname} after {optim.__name__} step", p.detach()[mask], q.detach()[mask])
            for (bname, b), e in zip(model.named_buffers(), eager.buffers()):
                _assert_same(f"{name} buffer {bname}", b, e)
            steps += 1
    assert (cm.stats.compiles, cm.stats.cache_hits, cm.stats.calls) == (1, steps - 1, steps)

    if name in ("conv", "transformer"):  # the models whose layers behave differently in eval mode
        model.eval()
        eager.eval()
        inputs, _ = ref.batch("test", 8, gen)
        with torch.no_grad():
            _assert_same(f"{name} eval output", cm(*inputs), eager(*inputs))
        assert cm.stats.compiles == 2  # eval mode is its own cache entry
        model.train()
        eager.train()
        inputs, _ = ref.batch("test", 8, gen)
        _assert_same(f"{name} output back in train mode", cm(*inputs), eager(*inputs))
        assert cm.stats.compiles == 2  # and train mode's is still there

    if name == "conv":
        # a frozen BatchNorm inside a training model: every submodule's mode is part of the key
        model.stem[1].eval()
        eager.stem[1].eval()
        inputs, _ = ref.batch("test", 8, gen)
        _assert_same("conv with a frozen BatchNorm", cm(*inputs), eager(*inputs))
        for (bname, b), e in zip(model.named_buffers(), eager.buffers()):
            _assert_same(f"buffer {bname}", b, e)
        assert model.stem[1].num_batches_tracked.item() == steps + 1  # frozen before the last call
        assert model.block[1].num_batches_tracked.item() == steps + 2
        assert cm.stats.compiles == 3


@torch.library.custom_op("tpudist_test::bessel", mutates_args=())
def _bessel(x: torch.Tensor) -> torch.Tensor:
    """A user's own op (a custom kernel): no lowering exists for it."""
    return torch.special.bessel_j0(x)


@_bessel.register_fake
def _bessel_fake(x):
    return torch.empty_like(x)


def test_unsupported_op_names_the_op_and_the_module_path():
    class Bessel(torch.nn.Module):
        def forward(self, x):
            return _bessel(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU(), Bessel()))
    cm = tpudist.compile(model)
    with pytest.raises(UnsupportedOpError) as info:
        cm(torch.randn(2, 4))
    assert isinstance(info.value, NotImplementedError)
    message = str(info.value)
    assert "tpudist_test.bessel.default" in message
    assert "module '1.1' (Bessel)" in message
    assert "supported_torch_ops()" in message
    assert "tpudist_test.bessel.default" not in supported_ops()


def test_untraceable_forward_and_unknown_options_are_clear_errors():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            # Python control flow on a value computed from a parameter (one from the inputs alone is
            # specialised and guarded: test_data_dependent.py)
            return x * 2 if (x * self.w).sum() > 0 else x

    with pytest.raises(CaptureError, match="DataDependent.forward") as info:
        tpudist.compile(DataDependent())(torch.randn(3))
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="takes no options"):
        tpudist.compile(torch.nn.Linear(2, 2), mesh="data")


def test_failing_decomposition_and_lowering_name_the_op_module_and_way_out(monkeypatch):
    """Failures inside torch's decomposition or inside a lowering are CaptureError /
    UnsupportedOpError naming the op, the module path and what to do, not a bare torch or JAX
    error. Stand-ins for a broken decomposition and a broken lowering, named as such below."""
    from tpudist.compile._torch.lowering import _capture, _registry

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.GELU()))
    table = dict(_capture._decompositions())

    def broken_gelu_decomposition(x, approximate="none"):  # stand-in: a decomposition that fails
        return x.view(-1, 7)

    table[torch.ops.aten.gelu.default] = broken_gelu_decomposition
    monkeypatch.setattr(_capture, "_decompositions", lambda: table)
    with pytest.raises(CaptureError) as info:
        tpudist.compile(model)(torch.randn(2, 4))
    message = str(info.value)
    assert "aten.gelu.default" in message and "module '1.0' (GELU)" in message and "outside the compiled" in message
    monkeypatch.undo()

    def broken_gelu_lowering(x, approximate="none"):  # stand-in: a lowering that fails
        raise ValueError("no such layout")

    entry = _registry.lookup(torch.ops.aten.gelu.default)
    monkeypatch.setitem(_registry._REGISTRY, torch.ops.aten.gelu.default,
                        _registry.Lowering(entry.op, broken_gelu_lowering))
    with pytest.raises(UnsupportedOpError) as info:
        tpudist.compile(model)(torch.randn(2, 4))
    message = str(info.value)
    assert "aten.gelu.default" in message and "module '1.0' (GELU)" in message
    assert "no such layout" in message and "(2, 4) torch.float32" in message


def test_autocast_around_a_compiled_module_runs_it_as_eager_autocast_does():
    """bf16 autocast around `cm(x)`: every output has eager autocast's dtype (convs and matmuls in
    bfloat16, a float32 sum stays float32), values within bfloat16 precision, float32
    gradients for the float32 parameters; outside autocast the module is float32 again."""
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.fc = torch.nn.Linear(16, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            c = self.conv(x)
            h = self.fc(c.flatten(2))
            return c, h, self.norm(h), h.softmax(-1), h.float().sum()

    torch.manual_seed(0)
    model = Mixed()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model)
    cm = tpudist.compile(model)
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = cm(x), eager(x)
    full = exact(x)  # float32: the reference both bfloat16 runs are judged against
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert (got[0].dtype, got[1].dtype, got[4].dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)

    def as_close(what, g, w, f):  # compiled bf16 is as near float32 as eager bf16 is (within 3x)
        error, floor = (g.float() - f).norm().item(), (w.float() - f).norm().item()
        assert error <= 3 * floor + 1e-6 * f.norm().item(), \
            f"{what}: compiled {error:.3g} from float32, eager {floor:.3g}"

    for i, (g, w, f) in enumerate(zip(got, want, full)):
        as_close(f"output {i}", g, w, f.detach())
    assert (got[1].float() - full[1]).norm() > 1e-4  # bfloat16 really was used
    for outputs in (got, want, full):
        sum(t.float().sum() for t in outputs).backward()
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        assert p.grad.dtype == torch.float32
        as_close(f"grad {name}", p.grad, q.grad, r.grad)
    assert cm(x)[1].dtype == torch.float32
    assert cm.stats.compiles == 2


def test_signatures_accumulation_unused_parameters_and_stale_backward():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(3, 2)
            self.unused = torch.nn.Linear(3, 2)

        def forward(self, x):
            logits = self.used(x)
            return logits, logits.argmax(dim=1)

    torch.manual_seed(0)
    model = Model()
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    for seed in range(2):  # no zero_grad in between: gradients accumulate, as in eager torch
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        (logits, labels), (eager_logits, eager_labels) = cm(xc), eager(xe)
        assert labels.dtype == torch.int64 and torch.equal(labels, eager_labels)
        F.cross_entropy(logits, labels).backward()
        F.cross_entropy(eager_logits, eager_labels).backward()
        _assert_same("input grad", xc.grad, xe.grad)
    _assert_same("accumulated grad", model.used.weight.grad, eager.used.weight.grad)
    assert model.unused.weight.grad is None and eager.unused.weight.grad is None

    # only a new input signature captures again; returning to a known one does not
    for n in (2, 4, 2):
        cm(torch.randn(n, 3))
    with torch.no_grad():
        cm(torch.randn(4, 3))  # no gradient needed: another executable, not another capture
    assert (cm.stats.compiles, cm.stats.cache_hits, cm.stats.calls) == (2, 4, 6)

    # stepping the optimizer between a forward and its backward fails, as it does in eager torch
    loss = cm(torch.randn(4, 3))[0].sum()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_module_returning_its_loss_gets_eager_gradients_for_any_cotangent():
    # A scalar output's forward and backward run as one executable; whatever scales the loss
    # afterwards (a mean over micro-batches, a GradScaler, the loss used twice) must still
    # reach every .grad as it does in eager torch.
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)

    torch.manual_seed(0)
    model = WithLoss()
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    g = torch.Generator().manual_seed(3)
    for scale in (lambda l: l, lambda l: l * 0.25, lambda l: l + 2 * l, lambda l: -l.exp()):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        for m in (model, eager):
            m.zero_grad()
        loss, eager_loss = cm(xc, y), eager(xe, y)
        _assert_same("loss", loss, eager_loss)
        scale(loss).backward()
        scale(eager_loss).backward()
        _assert_same("input grad", xc.grad, xe.grad)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            _assert_same(name, p.grad, q.grad)
    loss = cm(x, y)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_parameters_cross_to_xla_without_copies():
    from tpudist.compile._torch._convert import to_jax
    weight = torch.nn.Linear(16, 16).weight
    assert to_jax(weight).unsafe_buffer_pointer() == weight.data_ptr()


def test_forwards_before_one_backward_keep_their_own_inputs():
    # Small CPU inputs are copied into reused buffers; a second call must not overwrite what the
    # first call's backward still needs (its residuals), nor an output that is the input itself.
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

        def forward(self, x, scale):
            return self.net(x) * scale, x, scale.to(torch.float32).sum()

    torch.manual_seed(0)
    model = Model()
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(1, 4, (4, 1), generator=g)) for _ in range(3)]
    for m in (model, eager):
        m.zero_grad()
    got = [cm(x, s) for x, s in batches]        # three forwards, then one backward through all
    want = [eager(x, s) for x, s in batches]
    sum(out.square().sum() for out, _, _ in got).backward()
    sum(out.square().sum() for out, _, _ in want).backward()
    for (out, echoed, total), (eager_out, _, eager_total), (x, _) in zip(got, want, batches):
        _assert_same("output", out, eager_out)
        assert torch.equal(echoed, x), "an output that is the input changed with a later call's input"
        _assert_same("scale sum", total, eager_total)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        _assert_same(name, p.grad, q.grad)


def test_gradients_of_many_sizes_and_dtypes_reach_their_parameters():
    # Small gradients cross to torch packed in one buffer per dtype, large ones alone; each
    # .grad must be its own parameter's, usable in place by an optimizer, and accumulate.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 80),  # 96 KB weight
                                torch.nn.ReLU(), torch.nn.Linear(80, 4)).double()
    model[4].bias.data = model[4].bias.data.float()  # one float32 parameter among float64 ones
    eager = copy.deepcopy(model)

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return F.cross_entropy(self.net[:4](x) @ self.net[4].weight.T + self.net[4].bias, y)

    cm, reference = tpudist.compile(WithLoss(model)), WithLoss(eager)
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    for step in range(3):
        x, y = torch.randn(6, 8, dtype=torch.float64, generator=g), torch.randint(0, 4, (6,), generator=g)
        for opt in opts:
            opt.zero_grad()
        for _ in range(2):  # two backwards per step: the second accumulates into the first's .grad
            cm(x, y).backward()
            reference(x, y).backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad.dtype == p.dtype and p.grad.shape == p.shape, name
            # the bridge computes float64 in float32: compare at float32's precision
            _assert_same(f"step {step} {name} grad", p.grad, q.grad, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        _assert_same(f"{name} after 3 steps", p, q, rtol=1e-4, atol=1e-5)


@settings(max_examples=5, deadline=None, database=None)  # each example is a capture + two compiles
@given(shapes=st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5), min_size=2, max_size=6),
       large=st.booleans(), seed=st.integers(0, 2**16))
def test_each_parameter_gets_its_own_gradient_whatever_the_shapes(shapes, large, seed):
    """Small gradients cross as one buffer and each .grad is a view of its part of it: 0-d
    parameters, dims of size 1, one parameter over the packing limit crossing alone. Every .grad
    has its parameter's shape and layout and eager torch's values, through both backward forms:
    the loss inside the compiled module (its gradients come out of the forward's executable) and
    a vector output with the loss in eager torch (a backward executable)."""
    shapes = [tuple(s) for s in shapes] + ([(130, 130)] if large else [])  # 66 KB: crosses alone

    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes)

        def forward(self, x):  # one output per parameter, each with its own gradient
            return torch.stack([(p * p * (i + 1)).sum() * x[i] + p.sum() for i, p in enumerate(self.ps)])

    class Loss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, w):
            return (self.net(x) * w).sum()

    g = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(len(shapes), generator=g), torch.randn(len(shapes), generator=g)
    model = Params()
    eager = copy.deepcopy(model)
    Loss(eager)(x, w).backward()
    for compiled, run in ((tpudist.compile(Loss(model)), lambda cm: cm(x, w).backward()),
                          (tpudist.compile(model), lambda cm: (cm(x) * w).sum().backward())):
        model.zero_grad(set_to_none=True)
        run(compiled)
        for i, (p, q) in enumerate(zip(model.ps, eager.ps)):
            assert p.grad.shape == p.shape and p.grad.stride() == p.stride(), (i, p.shape, p.grad.stride())
            _assert_same(f"parameter {i} of shape {tuple(p.shape)}", p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_concurrent_calls_from_threads_each_get_their_own_result():
    import threading
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    cm = tpudist.compile(model)
    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    cm(inputs[0])  # compiled before the threads start
    errors: list[str] = []

    def work(x: torch.Tensor) -> None:
        want = model(x).detach()
        for _ in range(200):
            got = cm(x)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                errors.append(f"max error {(got - want).abs().max():.3g}")
                return

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
