"""The fused train step (`tpudist.compile_train_step`): forward, backward, gradient all-reduce and
the torch optimizer's update in one XLA executable.

References are eager torch: the same model and optimizer stepped by torch.optim on the same data.
Single-process checks run in this process; the data-parallel ones in ONE 2-process job with 2 CPU
devices per process (a module fixture), whose training must equal one eager process on the global
batch.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

import tpudist
from tpudist.testing import run_on_mesh

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    "sgd_maximize": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_amsgrad_wd": lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.05, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=0.01, maximize=True),
}
STEPS = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def batches(n: int = 8, count: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(count)]


def eager_train(model: nn.Module, opt: torch.optim.Optimizer, data, loss_fn=F.cross_entropy,
                clip: float | None = None) -> list[float]:
    losses = []
    for *inputs, target in data:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        if clip is not None:
            # over the parameters the optimizer trains, as the fused step's max_grad_norm does
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        opt.step()
        losses.append(loss.item())
    return losses


def assert_same_state(got: nn.Module, want: nn.Module, atol: float = 2e-6) -> None:
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=atol, err_msg=name)


def assert_same_optimizer_state(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    a, b = got.state_dict()["state"], want.state_dict()["state"]
    assert a.keys() == b.keys()
    for index in b:
        assert a[index].keys() == b[index].keys(), index
        for field, value in b[index].items():
            np.testing.assert_allclose(np.asarray(a[index][field]), np.asarray(value), rtol=1e-5, atol=2e-6,
                                       err_msg=f"param {index} {field}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_matches_torch_optim(name):
    model, ref = mlp(), mlp()
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    data = batches()
    losses = [step(batch).item() for batch in data]
    ref_losses = eager_train(ref, ref_opt, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
    assert step.stats.compiles == 1 and step.stats.calls == STEPS
    assert all(p.grad is None for p in model.parameters())  # documented: the fused step keeps grads in XLA


class Linear1(nn.Module):
    """A loss linear in its parameter: the gradient of one row is that row, exactly, on both sides."""

    def __init__(self, n: int):
        super().__init__()
        self.p = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        return (self.p * x[0]).sum()


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_adam_updates_equal_eager_torchs_to_float32_rounding(make):
    """With gradients both sides compute exactly, the fused Adam's moments and parameters equal
    eager torch's to a few float32 ulps: 1 - beta1 and 1 - beta2 are taken in doubles, as torch
    takes them (in float32, 1 - 0.999 is 1.3e-5 off, and every second moment with it). The first
    moment is a lerp whose two terms can cancel, where whether a multiply-add is fused (torch's
    kernel fuses it, XLA:CPU at -O0 does not) moves the last bits of the larger term: it is held to
    4 ulps of that term; the second moment (a sum of positive terms) and the parameters to 1e-6."""
    model, ref = Linear1(256), Linear1(256)
    opt, ref_opt = make(model.parameters(), lr=1e-3), make(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(1, 256, generator=g), torch.zeros(1)) for _ in range(3)]
    step = tpudist.compile_train_step(model, lambda out, target: out, opt)
    for batch in data:
        step(batch)
    eager_train(ref, ref_opt, data, loss_fn=lambda out, target: out)
    got, want = opt.state_dict()["state"][0], ref_opt.state_dict()["state"][0]
    ulp = np.finfo(np.float32).eps * max(float(np.abs(x).max()) for x, _ in data)  # |grad| bounds every term
    np.testing.assert_allclose(got["exp_avg"].numpy(), want["exp_avg"].numpy(), rtol=0, atol=4 * ulp)
    np.testing.assert_allclose(got["exp_avg_sq"].numpy(), want["exp_avg_sq"].numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(model.p.detach().numpy(), ref.p.detach().numpy(), rtol=1e-6, atol=0)


def test_param_groups_lr_schedule_and_clipping_match_eager():
    def make(model):
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.3},
                               {"params": model[3].parameters(), "momentum": 0.5}], lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)

    model, ref = mlp(), mlp()
    (opt, sched), (ref_opt, ref_sched) = make(model), make(ref)
    # model[1] (LayerNorm) is in no param group: it must stay as it is, as in eager torch
    step = tpudist.compile_train_step(model, F.cross_entropy, opt, max_grad_norm=0.5)
    for batch in batches(count=5):
        step(batch)
        sched.step()
        eager_train(ref, ref_opt, [batch], clip=0.5)
        ref_sched.step()
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
    assert step.stats.compiles == 1  # a new learning rate is an argument, not a recompile


def test_hand_edits_of_param_groups_between_steps_are_seen_as_eager_torch_sees_them():
    # a tensor learning rate changed in place, a momentum switched on, a group added: each takes
    # effect on the next step, as it does for torch.optim
    model, ref = mlp(), mlp()
    opts = [torch.optim.SGD(m[0].parameters(), lr=torch.tensor(0.1)) for m in (model, ref)]
    step = tpudist.compile_train_step(model, F.cross_entropy, opts[0])
    edits = [lambda o, m: o.param_groups[0]["lr"].fill_(0.02),
             lambda o, m: o.param_groups[0].update(momentum=0.9),
             lambda o, m: o.add_param_group({"params": list(m[3].parameters()), "lr": 0.05}),
             lambda o, m: None]
    for batch, edit in zip(batches(count=4), edits):
        step(batch)
        eager_train(ref, opts[1], [batch])
        for opt, m in zip(opts, (model, ref)):
            edit(opt, m)
    step(batches(count=1)[0])
    eager_train(ref, opts[1], batches(count=1))
    assert_same_state(model, ref)
    assert_same_optimizer_state(*opts)


def conv_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def test_conv_batchnorm_buffers_and_eval_mode_match_eager():
    model, ref = conv_net(), conv_net()
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    for batch in data:
        step(batch)
    eager_train(ref, ref_opt, data)
    assert_same_state(model, ref, atol=1e-5)   # includes BatchNorm's running statistics
    model.eval()
    ref.eval()
    step(data[0])
    eager_train(ref, ref_opt, data[:1])
    assert_same_state(model, ref, atol=1e-5)
    assert step.stats.compiles == 2  # train and eval


def test_changes_made_from_torch_between_steps_are_used():
    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    data = batches(count=6)
    for batch in data[:2]:
        step(batch)
    eager_train(ref, ref_opt, data[:2])
    # a checkpoint restore of both, and an in-place edit of one parameter
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for batch in data[2:4]:
        step(batch)
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    with torch.no_grad():
        model[3].bias.add_(1.0)
        ref[3].bias.add_(1.0)
    for batch in data[4:]:
        step(batch)
    eager_train(ref, ref_opt, data[4:])
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
    assert step.stats.state_reloads > 0


def test_parameters_frozen_and_unfrozen_between_steps_train_as_in_eager_torch():
    """Freezing a layer for some steps and training it again (`requires_grad_`), as fine-tuning does:
    a frozen parameter keeps its value and optimizer state, and starts its own Adam steps when
    trained again."""
    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    data = batches(count=6)
    for i, batch in enumerate(data):
        for m in (model, ref):
            m[0].requires_grad_(i >= 2)  # the first layer frozen for two steps
            m[3].weight.requires_grad_(i not in (3, 4))  # the last weight frozen in the middle
        step(batch)
        eager_train(ref, ref_opt, [batch])
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)


@pytest.mark.parametrize("adam", [False, True], ids=["sgd_momentum", "adam"])
@settings(max_examples=3, deadline=None, database=None, derandomize=True)  # each example: a capture, a compile
@given(shapes=st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5), min_size=2, max_size=6),
       large=st.booleans(), seed=st.integers(0, 2**16))
def test_parameters_of_any_shape_train_as_in_eager_torch(adam, shapes, large, seed):
    """On one device the step takes and returns the parameters and optimizer state as a pool of
    few buffers (every array of up to 4 KiB packed into one per dtype): 0-d parameters, dims of
    size 1, one parameter over the limit kept apart, with a door opened and a parameter edited
    from torch between steps, train exactly as eager torch does, parameters and optimizer state."""
    shapes = [tuple(s) for s in shapes] + ([(40, 40)] if large else [])  # 6.4 KB: outside the pool

    class Params(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g) / 4) for s in shapes)
            # weights in [1, 2): no element's gradient is near zero, where Adam would turn rounding
            # noise into whole steps of either sign
            self.ws = [1 + torch.rand(s, generator=g) for s in shapes]

        def forward(self, x):  # one logit per parameter, each with its own gradient
            return torch.stack([x[:, i] * (p * w).sum() / math.sqrt(p.numel())
                                for i, (p, w) in enumerate(zip(self.ps, self.ws))], dim=1)

    g = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(8, len(shapes), generator=g), torch.randint(0, len(shapes), (8,), generator=g))
            for _ in range(5)]
    make = (lambda ps: torch.optim.Adam(ps, lr=0.05)) if adam else (lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9))
    model, ref = Params(), Params()
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    for batch in data[:3]:
        step(batch)
    eager_train(ref, ref_opt, data[:3])
    assert_same_state(model, ref)                       # a door: the pool cut back into parameters
    with torch.no_grad():
        model.ps[0].add_(0.5)
        ref.ps[0].add_(0.5)
    losses = [step(batch).item() for batch in data[3:]]
    np.testing.assert_allclose(losses, eager_train(ref, ref_opt, data[3:]), rtol=1e-5)
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
    assert step.stats.compiles == 1


def test_parameters_of_two_dtypes_train_as_in_eager_torch():
    """A model holding float32 and bfloat16 parameters: each dtype has its own buffer in the pool,
    and the parameters come back in their own dtypes, trained as eager torch trains them (within
    bfloat16's precision where that layer computes in it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3).to(torch.bfloat16))

    class Mixed(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net[2](self.net[1](self.net[0](x)).to(torch.bfloat16)).float()

    model, ref = Mixed(net), Mixed(copy.deepcopy(net))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    data = batches(count=4)
    losses = [step(batch).item() for batch in data]
    np.testing.assert_allclose(losses, eager_train(ref, ref_opt, data), rtol=1e-3)
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        assert got.dtype == want.dtype, name
        tol = dict(atol=4e-3, rtol=1e-2) if got.dtype == torch.bfloat16 else dict(atol=5e-4, rtol=1e-4)
        np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), err_msg=name, **tol)


def test_errors_name_the_problem_and_the_fix():
    model = mlp()
    with pytest.raises(TypeError, match=r"RMSprop.*eager_step"):
        tpudist.compile_train_step(model, F.cross_entropy, torch.optim.RMSprop(model.parameters()))
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(count=1)[0]
    with pytest.raises(TypeError, match=r"rank 0: .*\(\*inputs, target\)"):
        step(x)
    with pytest.raises(ValueError, match=r"different leading sizes \[7, 8\]"):
        step((x[:7], y))
    nonscalar = tpudist.compile_train_step(model, lambda out, t: F.cross_entropy(out, t, reduction="none"),
                                           torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="one floating scalar"):
        nonscalar((x, y))
    double = mlp().double()
    with pytest.raises(TypeError, match=r"float64.*model.float\(\)"):
        tpudist.compile_train_step(double, F.cross_entropy, torch.optim.SGD(double.parameters(), lr=0.1))(
            (x.double(), y))


def test_compiled_module_with_sharded_embedding_equals_eager_in_one_process():
    torch.manual_seed(5)
    model = nn.Sequential(tpudist.nn.ShardedEmbedding(10, 4, mode="sum"), nn.Linear(4, 1))
    compiled = tpudist.compile(copy.deepcopy(model))
    ids = torch.tensor([[1, 2], [9, 9], [0, 5]])
    out, want = compiled(ids), model(ids)
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), rtol=1e-6)
    out.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(compiled.module.named_parameters(), model.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


class Dropped(nn.Module):
    """`(dropout(x) * w).sum(-1)`: with x all ones, w's gradient is the (negated) dropout mask."""

    def __init__(self, width: int = 64, p: float = 0.5):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return (self.drop(x) * self.w).sum(-1)


def mean_output(out, target):
    return -out.mean()


def test_dropout_in_the_fused_step_is_new_every_step_and_reproducible():
    def run(seed, steps=3):
        torch.manual_seed(seed)
        model = Dropped()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        step = tpudist.compile_train_step(model, mean_output, opt)
        x = torch.ones(1, 64)
        updates = []
        for _ in range(steps):
            before = model.state_dict()["w"].clone()   # state_dict(): a door to the device values
            step((x, torch.zeros(1)))
            updates.append((model.state_dict()["w"] - before).numpy())
        return np.stack(updates)

    first, again, other = run(0), run(0), run(1)
    np.testing.assert_array_equal(first, again)         # torch.manual_seed reproduces the masks
    assert not np.array_equal(first, other)
    assert not np.array_equal(first[0], first[1])        # a new mask every step
    # kept units are scaled by 1 / (1 - p): each update is 0 or 2, about half of each
    assert set(np.unique(first).tolist()) == {0.0, 2.0}
    assert 0.25 < (first == 0).mean() < 0.75


def test_autocast_around_the_fused_step_is_honoured_as_in_eager():
    """bf16 autocast around the step: the model runs under it (its output is bfloat16 inside the
    step, as in eager autocast) while parameters stay float32, and 3 steps equal eager autocast
    training within bfloat16's precision."""
    def loss_fn(out, target):  # adds 10 exactly when the model's output is bfloat16 (autocast on)
        return F.cross_entropy(out.float(), target) + (10.0 if out.dtype == torch.bfloat16 else 0.0)

    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = tpudist.compile_train_step(model, loss_fn, opt)
    losses, ref_losses = [], []
    for x, y in batches(count=3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(step((x, y)).item())
            ref_opt.zero_grad()
            loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert min(losses) > 10 and min(ref_losses) > 10
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-2, atol=2e-3, err_msg=name)
    # outside autocast the same step is float32 again: another signature
    assert step(batches(count=1)[0]).item() < 10
    assert step.stats.compiles == 2


def test_the_stop_flag_comes_back_for_the_step_it_went_in_and_training_is_unchanged():
    # one process, one device: the step carries the flag without any collective (fit's SIGTERM path)
    data = batches(count=4)
    model, ref = mlp(), mlp()
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    step, ref_opt = tpudist.compile_train_step(model, F.cross_entropy, make(model.parameters())), make(ref.parameters())
    step.signals = True
    seen = []
    for i, batch in enumerate(data):
        step.raise_signal(i == 2)
        step(batch)
        seen.append(float(np.asarray(step.signal)))
    assert seen == [0.0, 0.0, 1.0, 0.0]
    eager_train(ref, ref_opt, data)
    assert_same_state(model, ref)


def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch():
    data = batches(n=8, count=3)
    model, whole, ref = mlp(), mlp(), mlp()
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    accumulated = tpudist.compile_train_step(model, F.cross_entropy, make(model.parameters()), accumulate_steps=4)
    one = tpudist.compile_train_step(whole, F.cross_entropy, make(whole.parameters()))
    ref_opt = make(ref.parameters())
    for x, y in data:
        a, b = accumulated((x, y)).item(), one((x, y)).item()
        np.testing.assert_allclose(a, b, rtol=1e-5)
        ref_opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):   # eager torch's gradient accumulation
            (F.cross_entropy(ref(xm), ym) / 4).backward()
        ref_opt.step()
    assert_same_state(model, whole)
    assert_same_state(model, ref)
    with pytest.raises(ValueError, match=r"4 micro-batches; use a per-process batch size that is a multiple of 4"):
        accumulated(batches(n=6, count=1)[0])


def test_accumulation_with_batchnorm_matches_eager_accumulation_and_fit_groups_batches():
    """With BatchNorm the micro-batches are separate forwards (statistics per micro-batch, the
    running statistics updated once per micro-batch), as eager accumulation runs them; fit's
    accumulate_steps=2 makes two loader batches one step."""
    model, ref = conv_net(), conv_net()
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]),
                                                                        torch.cat([y for _, y in data])), batch_size=4)
    history = tpudist.fit(model, loader, opt, F.cross_entropy, accumulate_steps=2, log=False)
    losses = []
    for i in range(0, 6, 2):
        ref_opt.zero_grad()
        total = 0.0
        for x, y in data[i:i + 2]:
            loss = F.cross_entropy(ref(x), y) / 2
            loss.backward()
            total += loss.item()
        ref_opt.step()
        losses.append(total)
    assert_same_state(model, ref, atol=1e-5)   # parameters and running statistics
    assert history[0]["examples"] == 24
    np.testing.assert_allclose(history[0]["loss"], np.mean(losses), rtol=1e-5)


# -- data parallel: 2 processes x 2 CPU devices ------------------------------------------------------

N, DEVICES = 2, 2
VOCAB, DIM = 7, 3


class BagModel(nn.Module):
    def __init__(self, emb: nn.Module):
        super().__init__()
        self.emb = emb
        torch.manual_seed(4)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def bag_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    return [(torch.randint(0, VOCAB, (8, 3), generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def dense_table() -> torch.Tensor:
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(2))


def on_rank() -> dict:
    rank = tpudist.process_index()
    mine = slice(rank * 4, rank * 4 + 4)   # each process: half of every global batch of 8
    out: dict = {}
    for name in ("sgd_momentum_wd", "adamw"):
        model = mlp()
        step = tpudist.compile_train_step(model, F.cross_entropy, OPTIMIZERS[name](model.parameters()))
        out[name] = [step((x[mine], y[mine])).item() for x, y in batches()]
        out[name + "_params"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    model = BagModel(tpudist.nn.ShardedEmbedding.from_dense(dense_table(), mode="mean"))
    step = tpudist.compile_train_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5))
    for ids, y in bag_data():
        step((ids[mine], y[mine]))
    out["bag_table"] = model.emb.full_weight().numpy()
    out["bag_head"] = {k: v.numpy().copy() for k, v in model.head.state_dict().items()}
    # the same model under a plain tpudist.compile, stepped by optimizer_step: one program over the processes
    model = BagModel(tpudist.nn.ShardedEmbedding.from_dense(dense_table(), mode="mean"))
    compiled = tpudist.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    for ids, y in bag_data():
        opt.zero_grad()
        F.mse_loss(compiled(ids[mine]), y[mine]).backward()
        tpudist.optimizer_step(opt)
    out["compiled_bag_table"] = model.emb.full_weight().numpy()
    out["compiled_bag_head"] = {k: v.numpy().copy() for k, v in model.head.state_dict().items()}
    out["compiled_bag_compiles"] = compiled.stats.compiles
    # dropout: every device its own mask (x all ones, one row per device: w's update is the mean
    # over the 4 devices of their masks)
    torch.manual_seed(0)
    model = Dropped()
    step = tpudist.compile_train_step(model, mean_output, torch.optim.SGD(model.parameters(), lr=1.0))
    step((torch.ones(DEVICES, 64), torch.zeros(DEVICES)))
    out["dropout_update"] = model.state_dict()["w"].numpy().copy()
    # JAX's binomial sampler cannot run with a per-device key: an error, not a wrong draw
    model = Binomial()
    step = tpudist.compile_train_step(model, mean_output, torch.optim.SGD(model.parameters(), lr=1.0))
    try:
        step((torch.ones(DEVICES, 4), torch.zeros(DEVICES)))
    except tpudist.UnsupportedOpError as exc:
        out["binomial_error"] = str(exc)
    return out


class Binomial(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.w * torch.binomial(torch.full_like(x, 3.0), x / 2)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_mesh(on_rank, nprocs=N, cpu_devices=DEVICES, timeout=300)


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_data_parallel_fused_step_equals_one_process_on_the_global_batch(ranks, name):
    ref = mlp()
    ref_losses = eager_train(ref, OPTIMIZERS[name](ref.parameters()), batches())
    for rank, result in enumerate(ranks):
        for (key, value), want in zip(result[name + "_params"].items(), ref.state_dict().values()):
            np.testing.assert_allclose(value, want.numpy(), rtol=1e-5, atol=2e-6, err_msg=f"rank {rank} {key}")
    # each process returns its own half's loss; their mean is the global batch's loss
    np.testing.assert_allclose(np.mean([r[name] for r in ranks], axis=0), ref_losses, rtol=1e-5)


@pytest.mark.parametrize("how", ["bag", "compiled_bag"])
def test_sharded_embedding_trains_compiled_like_a_dense_bag(ranks, how):
    """`bag`: inside the fused step; `compiled_bag`: a plain tpudist.compile(model) + optimizer_step."""
    ref = BagModel(nn.EmbeddingBag.from_pretrained(dense_table(), freeze=False, mode="mean"))
    eager_train(ref, torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.5), bag_data(), loss_fn=F.mse_loss)
    for rank, result in enumerate(ranks):
        np.testing.assert_allclose(result[f"{how}_table"], ref.emb.weight.detach().numpy(), rtol=1e-5, atol=2e-6,
                                   err_msg=f"rank {rank} table")
        for key, value in result[f"{how}_head"].items():
            np.testing.assert_allclose(value, ref.head.state_dict()[key].numpy(), rtol=1e-5, atol=2e-6,
                                       err_msg=f"rank {rank} head.{key}")
    if how == "compiled_bag":
        assert [r["compiled_bag_compiles"] for r in ranks] == [1, 1]


def test_dropout_masks_differ_across_devices_and_processes(ranks):
    updates = [r["dropout_update"] for r in ranks]
    np.testing.assert_array_equal(updates[0], updates[1])   # one update, the same on every process
    # the mean of 4 devices' masks (each 0 or 2 per unit): identical masks would give only 0 or 2
    levels = set(np.round(updates[0], 4).tolist())
    assert levels <= {0.0, 0.5, 1.0, 1.5, 2.0} and levels & {0.5, 1.0, 1.5}, levels


def test_a_random_op_jax_cannot_draw_per_device_is_an_error_on_every_rank(ranks):
    for rank in ranks:
        assert "aten.binomial" in rank.get("binomial_error", "") and "outside the step" in rank["binomial_error"]


def test_torch_example_trains_through_the_launcher():
    """examples/train_torch.py: tpudist.fit with a ShardedEmbedding model, 2 processes started by
    the real launcher (local mode: no SSH needed)."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2", "--",
         sys.executable, "examples/train_torch.py", "--epochs", "3", "--examples", "4096", "--lr", "0.01"],
        cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    loss = re.search(r"processes 2, 3 epochs, loss (\d\.\d+) -> (\d\.\d+)", done.stdout)
    accuracy = re.search(r"accuracy (\d\.\d+) -> (\d\.\d+)", done.stdout)
    assert loss and accuracy, done.stdout
    assert float(loss[2]) < float(loss[1]) - 0.05
    assert float(accuracy[2]) > max(0.6, float(accuracy[1]) + 0.1)
    assert "Warning" not in done.stderr.replace("[Gloo]", ""), done.stderr


@torch.library.custom_op("tpudist_test::log_gamma", mutates_args=())
def _log_gamma(x: torch.Tensor) -> torch.Tensor:
    """A user's own op (a custom kernel), differentiable in torch, with no lowering."""
    return torch.lgamma(x)


@_log_gamma.register_fake
def _log_gamma_fake(x):
    return torch.empty_like(x)


def _log_gamma_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


_log_gamma.register_autograd(lambda ctx, g: g * torch.digamma(ctx.saved_tensors[0]), setup_context=_log_gamma_context)


def test_fit_names_eager_step_when_the_model_cannot_be_compiled():
    class LogGamma(nn.Module):
        def forward(self, x):
            return _log_gamma(x.abs() + 1.0)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 3), LogGamma())

    data = torch.utils.data.TensorDataset(*batches(n=16, count=1)[0])
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = build()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)   # not implemented in-graph either
    with pytest.raises(TypeError, match="eager_step"):
        tpudist.fit(model, loader, opt, F.cross_entropy, log=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tpudist.UnsupportedOpError, match=r"log_gamma.*step_fn=tpudist.eager_step"):
        tpudist.fit(model, loader, opt, F.cross_entropy, log=False)
    # the fallback the message names trains it, and equals eager torch
    ref = build()
    history = tpudist.fit(model, loader, opt, F.cross_entropy, log=False,
                          step_fn=tpudist.eager_step(model, F.cross_entropy, opt))
    eager_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), list(loader))
    assert len(history) == 1
    assert_same_state(model, ref)


def _refilled(data: list, x: torch.Tensor, y: torch.Tensor):
    """One (x, y) pair of tensors, refilled in place with each batch of `data` in turn."""
    for a, b in data:
        x.copy_(a)
        y.copy_(b)
        yield x, y


# rows of 512 float32: 32 KiB (copied into reused buffers), 128 KiB and 512 KiB (their own copies)
@pytest.mark.parametrize("rows", [16, 64, 256])
@pytest.mark.parametrize("through_loader", [False, True])
def test_a_batch_refilled_in_place_after_each_call_trains_as_in_eager_torch(rows, through_loader):
    """A batch may be written by its owner as soon as `step(batch)` (or `device_loader`) returns,
    as in eager torch: the step runs later, so its values must be taken at the call."""
    g = torch.Generator().manual_seed(rows)
    data = [(torch.randn(rows, 512, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 4))
    reference = copy.deepcopy(model)
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    refilled = _refilled(data, torch.empty(rows, 512), torch.empty(rows, dtype=torch.long))
    # no loss is read before the last step is queued: the steps run behind the loop
    losses = [step(batch) for batch in (tpudist.device_loader(refilled) if through_loader else refilled)]
    want = eager_train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), data)
    np.testing.assert_allclose([float(loss) for loss in losses], want, rtol=1e-5)
    assert_same_state(model, reference)


def test_small_batches_refilled_while_the_device_lags_train_as_in_eager_torch():
    """Small batches are copied into a few reused buffer sets; with the host steps ahead of a slow
    device, every set is written again while later steps are still queued: the host must not
    overwrite a set before the step that reads it has run."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 512, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(24)]
    torch.manual_seed(0)
    # ~1 ms of device work a step against ~0.1 ms of host work: the host runs ahead
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
    reference = copy.deepcopy(model)
    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.05))
    losses = [step(batch) for batch in _refilled(data, torch.empty(16, 512), torch.empty(16, dtype=torch.long))]
    want = eager_train(reference, torch.optim.SGD(reference.parameters(), lr=0.05), data)
    np.testing.assert_allclose([float(loss) for loss in losses], want, rtol=1e-5)
    assert_same_state(model, reference, atol=1e-5)


@pytest.mark.parametrize("adam", [False, True], ids=["sgd_momentum", "adam"])
def test_small_parameters_updated_together_keep_their_own_step_counts_and_groups(adam):
    """On one device the parameters of up to 4 KiB take their update as one concatenated array per
    optimizer configuration, group and dtype: each element must still follow its own parameter's
    step count (Adam's bias corrections; SGD's first momentum step) and its own group's numbers.
    Here three of six parameters trained eagerly first (the others had no gradient, so torch did
    not step them), in two groups with different hyperparameters (amsgrad in one)."""
    class Params(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.ps = nn.ParameterList(nn.Parameter(torch.randn(5, generator=g)) for _ in range(6))
            self.ws = [1 + torch.rand(5, generator=g) for _ in range(6)]
            self.only = 6

        def forward(self, x):
            return torch.stack([x[:, i] * (p * w).sum() if i < self.only else x[:, i] * 0
                                for i, (p, w) in enumerate(zip(self.ps, self.ws))], dim=1)

    def make(m):
        ps = list(m.ps)
        groups = [{"params": [ps[0], ps[1], ps[3]], "lr": 0.03}, {"params": [ps[2], ps[4], ps[5]], "lr": 0.1}]
        if adam:
            groups[0].update(amsgrad=True, weight_decay=0.1)
            return torch.optim.Adam(groups, betas=(0.8, 0.95))
        groups[0].update(weight_decay=0.1)
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.2)

    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 6, (8,), generator=g)) for _ in range(5)]
    model, ref = Params(), Params()
    opt, ref_opt = make(model), make(ref)
    for m, o in ((model, opt), (ref, ref_opt)):  # p0, p1, p2 step twice; p3, p4, p5 have no gradient
        m.only = 3
        for x, y in data[:2]:
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            for p in list(m.ps)[3:]:
                p.grad = None
            o.step()
        m.only = 6
    step = tpudist.compile_train_step(model, F.cross_entropy, opt)
    losses = [step(batch).item() for batch in data[2:]]
    np.testing.assert_allclose(losses, eager_train(ref, ref_opt, data[2:]), rtol=1e-5)
    assert_same_state(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
