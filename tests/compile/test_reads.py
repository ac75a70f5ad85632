"""A plain read of a trained tensor after fused steps sees the values after the last step.

No door is opened (`state_dict()`, an eager call, `step.sync()`): the read itself is the door (see
tpudist/compile/_torch/train/_stale.py). Three fused steps, then `named_parameters()` values and
the optimizer's state, compared with eager torch after three `torch.optim` steps. The tolerance is
eager's own: the fused value must be as close to float64 eager as float32 eager is (test_zoo's
`assert_as_accurate`). The reads (the `host` fixture) are checked both where torch views the
device memory (CPU) and where each crossing is a copy (as on a TPU: `HOST_VIEW = False`).
"""

from __future__ import annotations

import copy
import io
import pickle

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist.compile._torch.train import _state
from tpudist.testing import run_on_mesh

from test_zoo import ZOO, as_double, as_float64, assert_as_accurate, make_batch
from test_zoo import build as build_zoo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(params=["view", "copy"])
def host(request, monkeypatch):
    """Both ways a value crosses to torch: a zero-copy view (CPU), a copy (a TPU, forced here)."""
    if request.param == "copy":
        monkeypatch.setattr(_state, "HOST_VIEW", False)
    _state.crossings.clear()
    return _state.crossings


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def _sequences(seed: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, width, generator=g), torch.randint(0, 3, (4,), generator=g)


# name -> (build the float32 model, the batch of step i, the loss_fn: None when the model returns its loss)
MODELS = {
    "bert": (lambda: build_zoo("bert"), lambda i: make_batch(ZOO["bert"].kind, 10 + i), None),
    "gpt2": (lambda: build_zoo("gpt2"), lambda i: make_batch(ZOO["gpt2"].kind, 10 + i), None),
    "lstm": (Recurrent, lambda i: _sequences(10 + i, 6), F.cross_entropy),
    "multihead_attention": (Attention, lambda i: _sequences(10 + i, 8), F.cross_entropy),
}
OPTIMIZERS = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), "momentum_buffer"),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "exp_avg"),
}


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer, batch, loss_fn) -> None:
    opt.zero_grad()
    if loss_fn is None:
        loss = model(**batch).loss
    else:
        *inputs, target = batch
        loss = loss_fn(model(*inputs), target)
    loss.backward()
    opt.step()


def _double(batch):
    return as_double(batch) if isinstance(batch, dict) else tuple(
        t.double() if t.is_floating_point() else t for t in batch)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_plain_read_after_three_fused_steps_equals_eager_torch(name, optimizer, host):
    make_model, make, loss_fn = MODELS[name]
    make_opt, field = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    model = make_model()
    eager, exact = copy.deepcopy(model), (as_float64(model) if loss_fn is None else copy.deepcopy(model).double())
    opt, eager_opt, exact_opt = make_opt(model.parameters()), make_opt(eager.parameters()), make_opt(exact.parameters())
    step = tpudist.compile_train_step(model, loss_fn, opt)
    for i in range(3):
        step(make(i))
        _eager_step(eager, eager_opt, make(i), loss_fn)
        _eager_step(exact, exact_opt, _double(make(i)), loss_fn)
    assert host["to_host"] == 0  # three steps, nothing read back yet
    got = {n: p.data for n, p in model.named_parameters()}  # no door: the first .data is one
    params = dict(model.named_parameters())
    for (n, want), want64 in zip(eager.named_parameters(), exact.parameters()):
        assert_as_accurate(f"{name} {optimizer} {n}", got[n], want, want64)
        assert_as_accurate(f"{name} {optimizer} {field} of {n}", opt.state[params[n]][field],
                           eager_opt.state[want][field], exact_opt.state[want64][field])


class Eager:
    """The reference: eager torch in float32 and in float64, stepped alike; a fused value must be as
    close to the float64 one as float32 eager is (`check`)."""

    def __init__(self, model: nn.Module, make_opt):
        self.models = [copy.deepcopy(model), copy.deepcopy(model).double()]
        self.opts = [make_opt(m.parameters()) for m in self.models]

    def step(self, batch) -> None:
        for model, opt, b in zip(self.models, self.opts, (batch, _double(batch))):
            _eager_step(model, opt, b, F.cross_entropy)

    def check(self, what: str, got: torch.Tensor, pick) -> None:
        """`got` against `pick(model, optimizer)` of each reference."""
        want, exact = (pick(m, o) for m, o in zip(self.models, self.opts))
        assert_as_accurate(what, got.detach().to(exact.dtype), want, exact)

    def check_all(self, model: nn.Module, opt: torch.optim.Optimizer, field: str) -> None:
        """Every parameter and buffer of `model`, and each parameter's optimizer-state `field`."""
        names = dict(model.named_parameters())
        for name, value in model.named_buffers():
            if value.is_floating_point():
                self.check(name, value, lambda m, o, name=name: m.get_buffer(name))
        for name, p in names.items():
            self.check(name, p, lambda m, o, name=name: m.get_parameter(name))
            self.check(f"{field} of {name}", opt.state[p][field],
                       lambda m, o, name=name: o.state[m.get_parameter(name)][field])


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _trained(optimizer: str = "sgd_momentum"):
    """A small model with BatchNorm after three fused steps, and the same three steps in eager torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    make_opt, _ = OPTIMIZERS[optimizer]
    ref = Eager(model, make_opt)
    opt = make_opt(model.parameters())
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    for i in range(3):
        step(_batch(i))
        ref.step(_batch(i))
    return model, opt, ref, step


# each read done first after the steps, on `model[3].weight` (a parameter), its momentum, or a BatchNorm buffer
WEIGHT = lambda m, o: m[3].weight  # noqa: E731
MOMENTUM = lambda m, o: o.state[m[3].weight]["momentum_buffer"]  # noqa: E731
READS = {  # name: (the read, what it reads in the reference)
    "data": (lambda m, o: m[3].weight.data, WEIGHT),
    "clone": (lambda m, o: m[3].weight.clone(), WEIGHT),
    "detach": (lambda m, o: m[3].weight.detach(), WEIGHT),
    "cpu": (lambda m, o: m[3].weight.cpu(), WEIGHT),
    "numpy": (lambda m, o: torch.from_numpy(m[1].running_mean.numpy()), lambda m, o: m[1].running_mean),
    "op": (lambda m, o: m[3].weight * 1, WEIGHT),
    "norm": (lambda m, o: m[3].weight.norm(), lambda m, o: m[3].weight.norm()),
    "getitem": (lambda m, o: m[3].weight[0], lambda m, o: m[3].weight[0]),
    "repr": (lambda m, o: m[3].weight.data if repr(m[3].weight) else None, WEIGHT),
    "pickle": (lambda m, o: pickle.loads(pickle.dumps(m[3].weight)), WEIGHT),
    "deepcopy": (lambda m, o: copy.deepcopy(m)[3].weight, WEIGHT),
    "torch_save": (lambda m, o: torch.load(_saved(m[3].weight), weights_only=True), WEIGHT),
    "to_float64": (lambda m, o: m.to(torch.float64)[3].weight, WEIGHT),
    "buffer": (lambda m, o: m[1].running_var + 0, lambda m, o: m[1].running_var),
    "optimizer_state": (MOMENTUM, MOMENTUM),
    "held_momentum": (None, MOMENTUM),  # a momentum buffer taken before the last step (in the test)
}


def _saved(t: torch.Tensor) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("read", sorted(READS))
def test_any_read_through_torch_is_current(read, host):
    model, opt, ref, step = _trained()
    how, reference = READS[read]
    if how is None:
        model.state_dict()  # a door: torch now holds the momentum buffers
        held = opt.state[model[3].weight]["momentum_buffer"]
        step(_batch(3))
        ref.step(_batch(3))
        got = held.clone()
    else:
        got = how(model, opt)
    ref.check(read, got, reference)
    assert type(got) in (torch.Tensor, nn.Parameter)  # results are plain tensors


def test_metadata_reads_cross_nothing_and_the_next_steps_see_torch_edits(host):
    model, opt, ref, step = _trained("adamw")
    w = model[3].weight
    assert w.shape == (3, 16) and w.dtype == torch.float32 and w.grad is None and w.requires_grad
    assert w in set(model.parameters()) and len(w) == 3 and w.dim() == 2
    opt.zero_grad()
    assert host["to_host"] == 0  # none of these read a value
    # an in-place edit as the first read: it edits the newest values, and the next step trains from them
    with torch.no_grad():
        w.add_(0.5)
        for m in ref.models:
            m[3].weight.add_(0.5)
    step(_batch(3))
    ref.step(_batch(3))
    ref.check_all(model, opt, "exp_avg")
    assert type(opt.state).__name__ == "defaultdict"  # plain again once read
    held = opt.state[w]["step"]  # Adam's step count, held across a step as a momentum buffer may be
    assert int(held) == 4
    step(_batch(4))
    assert int(held) == 5


def test_a_torch_compiled_model_and_an_export_see_the_newest_values():
    model, opt, ref, step = _trained()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    model.eval()
    for m in ref.models:
        m.eval()
    with torch.no_grad():
        ref.check("torch.compile", torch.compile(model, backend="tpudist")(x), lambda m, o: m(x.to(m[0].weight.dtype)))
    model.train()
    for m in ref.models:
        m.train()
    step(_batch(5))
    ref.step(_batch(5))
    model.eval()
    for m in ref.models:
        m.eval()
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        ref.check("torch.export", exported.module()(x), lambda m, o: m(x.to(m[0].weight.dtype)))


def test_a_dropped_step_still_hands_over_its_values():
    model, opt, ref, step = _trained()
    del step  # the newest values live on the devices only: the stale tensors keep them reachable
    ref.check("dropped", model[0].weight, lambda m, o: m[0].weight)


def _read_on_one_process() -> dict:
    """Two fused FSDP steps over two processes, then a read on rank 0 alone, then a door on both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                      mesh=tpudist.mesh.make_mesh({"fsdp": -1}),
                                      sharding=tpudist.Sharding(fsdp=True, min_bytes=0))  # small, split all the same
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        step((torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)))
    error = None
    if jax.process_index() == 0:
        try:
            model[0].weight.sum()
        except RuntimeError as e:
            error = str(e)
    storage = model[0].weight.untyped_storage().nbytes()  # a size, not a read: no sync
    step.sync()  # the door, on every process
    return {"error": error, "storage": storage, "read": model[0].weight.detach().clone(),
            "door": model.state_dict()["0.weight"]}


def test_a_read_that_would_start_a_collective_on_one_process_raises_saying_how():
    first, second = run_on_mesh(_read_on_one_process, nprocs=2, cpu_devices=1, timeout=300)
    assert first["error"] is not None and "call step.sync() (or model.state_dict()) on every process" \
        in first["error"] and first["error"].startswith("rank 0: ")
    assert first["storage"] == second["storage"] == 16 * 6 * 4
    assert torch.equal(first["read"], first["door"]) and torch.equal(first["read"], second["read"])


def test_two_steps_training_one_model_in_turn_read_and_train_on_each_others_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    make_opt, _ = OPTIMIZERS["sgd_momentum"]
    ref, opt = Eager(model, make_opt), make_opt(model.parameters())
    steps = [tpudist.compile_train_step(model, F.cross_entropy, opt) for _ in range(2)]
    for i in range(6):
        steps[i % 2](_batch(i))
        ref.step(_batch(i))
        if i in (2, 3):  # a plain read between the steps of the two
            ref.check(f"after step {i + 1}", model[0].weight, lambda m, o: m[0].weight)
    ref.check_all(model, opt, "momentum_buffer")
