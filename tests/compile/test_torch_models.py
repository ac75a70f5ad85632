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

import tpudist

# the public entry point, resolved through tpudist's lazy exports before any tpudist.compile
# submodule is imported: importing one first would bind the name tpudist.compile to the package
tpudist_compile = tpudist.compile
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
    cm = tpudist_compile(model)
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
        cm(*ref.batch("test", 8, gen)[0])
        assert cm.stats.compiles == 2  # and train mode's is still there


def test_batch_norm_running_stats_and_mixed_modes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, bias=False), torch.nn.BatchNorm2d(3, momentum=0.3),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.BatchNorm1d(48))
    eager = copy.deepcopy(model)
    cm = tpudist_compile(model)
    x = torch.randn(5, 2, 6, 6)
    for _ in range(2):
        cm(x).sum().backward()
        eager(x).sum().backward()
    # a frozen BatchNorm inside a training model: the per-submodule modes are part of the key
    model[1].eval()
    eager[1].eval()
    _assert_same("mixed-mode output", cm(x), eager(x))
    for (bname, b), e in zip(model.named_buffers(), eager.buffers()):
        _assert_same(f"buffer {bname}", b, e)
    assert model[1].num_batches_tracked.item() == 2 and model[4].num_batches_tracked.item() == 3
    assert cm.stats.compiles == 2


def test_recompiles_only_for_new_signatures():
    ref = REFERENCES["mlp"]
    cm = tpudist_compile(ref.build("test"))
    gen = torch.Generator().manual_seed(0)
    for n in (8, 8, 4, 8, 4):
        cm(*ref.batch("test", n, gen)[0])
    with torch.no_grad():
        cm(*ref.batch("test", 8, gen)[0])  # no gradient needed: another executable, not another capture
    assert (cm.stats.compiles, cm.stats.cache_hits) == (2, 4)


def test_unsupported_op_names_the_op_and_the_module_path():
    class Bessel(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU(), Bessel()))
    cm = tpudist_compile(model)
    with pytest.raises(UnsupportedOpError) as info:
        cm(torch.randn(2, 4))
    assert isinstance(info.value, NotImplementedError)
    message = str(info.value)
    assert "aten.special_bessel_j0.default" in message
    assert "module '1.1' (Bessel)" in message
    assert "supported_torch_ops()" in message
    assert "aten.special_bessel_j0.default" not in supported_ops()


def test_untraceable_forward_and_unknown_options_are_clear_errors():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # Python control flow on a tensor's value

    with pytest.raises(CaptureError, match="DataDependent.forward") as info:
        tpudist_compile(DataDependent())(torch.randn(3))
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="takes no options"):
        tpudist_compile(torch.nn.Linear(2, 2), mesh="data")


def test_accumulation_unused_parameters_input_gradients_and_stale_backward():
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
    cm = tpudist_compile(model)
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

    # stepping the optimizer between a forward and its backward fails, as it does in eager torch
    loss = cm(torch.randn(4, 3))[0].sum()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert cm.stats.compiles == 1


def test_parameters_cross_to_xla_without_copies():
    from tpudist.compile._torch._convert import to_jax
    weight = torch.nn.Linear(16, 16).weight
    assert to_jax(weight).unsafe_buffer_pointer() == weight.data_ptr()
