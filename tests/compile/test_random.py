"""Every random op torch has, compiled: fresh draws on every call and every fused step, torch's distribution.

The compiled stream is JAX's, not torch's, so values cannot be compared one by one. Each op is
judged instead by (a) two compiled calls (and two fused steps) drawing different values, and (b) a
two-sample Kolmogorov-Smirnov test between a large compiled draw and a large eager torch draw of the
same op and arguments, at a significance of 1e-6 (seeded, so a run is reproducible: a failure is a
wrong distribution, not bad luck). Ops with structure beyond their marginal distribution
(dropout's scaling, channel-wise masks, permutations, multinomial without replacement) get that
structure checked as well.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpudist

pytestmark = pytest.mark.filterwarnings("ignore")
N = 16384


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a.ravel()), np.sort(b.ravel())
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, side="right") / a.size
                        - np.searchsorted(b, grid, side="right") / b.size).max())


def assert_same_distribution(name: str, got: torch.Tensor, want: torch.Tensor, alpha: float = 1e-6) -> None:
    got, want = got.detach().double().numpy(), want.detach().double().numpy()
    d = _ks_statistic(got, want)
    n, m = got.size, want.size
    critical = math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))
    assert d <= critical, (f"{name}: compiled draws differ in distribution from eager torch's (KS statistic {d:.4f} > "
                           f"{critical:.4f}; compiled mean {got.mean():.4f} std {got.std():.4f}, eager mean "
                           f"{want.mean():.4f} std {want.std():.4f})")


# name -> a function of a (N,) float tensor `x` (values in [0.1, 0.9]) returning draws
OPS = {
    "rand": lambda x: torch.rand(N) + 0 * x,
    "randn": lambda x: torch.randn(N, dtype=x.dtype),
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x),
    "randint": lambda x: torch.randint(3, 10, (N,)),
    "randint_like": lambda x: torch.randint_like(x, 7),
    "randint_like(low, high)": lambda x: torch.randint_like(x, 2, 9),
    "bernoulli(p tensor)": lambda x: torch.bernoulli(x),
    "bernoulli(p float)": lambda x: torch.bernoulli(x, 0.3),
    "bernoulli_(p float)": lambda x: x.clone().bernoulli_(0.3),
    "bernoulli_(p tensor)": lambda x: torch.empty_like(x).bernoulli_(x),
    "uniform_": lambda x: x.clone().uniform_(-2, 3),
    "normal_": lambda x: x.clone().normal_(1, 2),
    "normal(tensor, tensor)": lambda x: torch.normal(x, x * 3),
    "normal(tensor, float)": lambda x: torch.normal(x, 2.0),
    "normal(float, tensor)": lambda x: torch.normal(1.0, x * 3),
    "normal(float, float, size)": lambda x: torch.normal(1.0, 2.0, (N,)),
    "exponential_": lambda x: x.clone().exponential_(2.0),
    "cauchy_": lambda x: x.clone().cauchy_(1.0, 0.5),
    "geometric_": lambda x: x.clone().geometric_(0.3),
    "log_normal_": lambda x: x.clone().log_normal_(0.5, 0.4),
    "random_()": lambda x: x.clone().random_(),
    "random_(to)": lambda x: x.clone().random_(11),
    "multinomial (replacement)": lambda x: torch.multinomial(torch.tensor([0.1, 0.0, 0.5, 0.4]) + 0 * x[:4],
                                                             N, replacement=True),
    "poisson": lambda x: torch.poisson(x * 5),
    "_standard_gamma": lambda x: torch._standard_gamma(x * 4),
    "binomial": lambda x: torch.binomial(torch.full_like(x, 6.0), x),
    "_sample_dirichlet": lambda x: torch._sample_dirichlet(x.reshape(-1, 4) * 3)[:, 0],
    "dropout": lambda x: F.dropout(torch.ones_like(x), 0.3, training=True),
    "dropout1d": lambda x: F.dropout1d(torch.ones_like(x).reshape(64, -1, 4), 0.3, training=True)[..., 0],
    "dropout2d": lambda x: F.dropout2d(torch.ones_like(x).reshape(16, -1, 2, 2), 0.3, training=True)[..., 0, 0],
    "dropout3d": lambda x: F.dropout3d(torch.ones_like(x).reshape(16, -1, 2, 2, 1), 0.3,
                                       training=True)[..., 0, 0, 0],
    "alpha_dropout": lambda x: F.alpha_dropout(torch.ones_like(x), 0.3, training=True),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(torch.ones_like(x).reshape(64, -1, 4), 0.3,
                                                               training=True)[..., 0],
    "rrelu": lambda x: F.rrelu(-torch.ones_like(x), 0.1, 0.4, training=True),
    "drop_path (keep + rand, floor_)": lambda x: (0.7 + torch.rand(N, 1, dtype=x.dtype)).floor_()[:, 0],
}


class Draws(torch.nn.Module):
    def __init__(self, fns):
        super().__init__()
        self.fns = fns

    def forward(self, x):
        return tuple(fn(x) for fn in self.fns.values())


def _base():
    return torch.linspace(0.1, 0.9, N)


def test_every_random_op_draws_anew_each_call_with_torchs_distribution():
    x = _base()
    torch.manual_seed(0)
    compiled = tpudist.compile(Draws(OPS))
    first, second = compiled(x), compiled(x)
    torch.manual_seed(1)
    eager = Draws(OPS)(x)
    for name, a, b, want in zip(OPS, first, second, eager):
        assert a.shape == want.shape and a.dtype == want.dtype, (name, a.shape, a.dtype, want.shape, want.dtype)
        assert not torch.equal(a, b), f"{name}: two compiled calls drew the same values"
        assert_same_distribution(name, a, want)
    # dropout keeps values scaled by 1 / (1 - p), exactly as torch
    kept = dict(zip(OPS, first))["dropout"]
    assert torch.equal(torch.unique(kept), torch.unique(dict(zip(OPS, eager))["dropout"]))


def test_channel_masks_keep_or_drop_whole_channels():
    class Channels(torch.nn.Module):
        def forward(self, x):
            return (F.dropout1d(x.reshape(8, 16, 8), 0.5, training=True),
                    F.dropout2d(x.reshape(8, 16, 2, 4), 0.5, training=True),
                    F.dropout3d(x.reshape(8, 16, 2, 2, 2), 0.5, training=True),
                    F.feature_alpha_dropout(x.reshape(8, 16, 8), 0.5, training=True))
    torch.manual_seed(0)
    for out in tpudist.compile(Channels())(torch.ones(1024)):
        flat = out.reshape(8, 16, -1)
        assert torch.equal(flat.amin(-1), flat.amax(-1)), "a channel was partly dropped"
        kept = (flat[..., 0] == flat.max()).float().mean()
        assert 0.3 < kept < 0.7


def test_permutations_and_draws_without_replacement():
    class Perm(torch.nn.Module):
        def forward(self, probabilities):
            return torch.randperm(64), torch.multinomial(probabilities, 3, replacement=False)
    torch.manual_seed(0)
    compiled = tpudist.compile(Perm())
    weights = torch.tensor([[0.1, 0.0, 0.5, 0.4, 0.0]]).repeat(4096, 1)
    (perm, picks), (perm2, _) = compiled(weights), compiled(weights)
    assert torch.equal(perm.sort().values, torch.arange(64)) and not torch.equal(perm, perm2)
    # three distinct categories per row, never one of weight 0
    assert bool((picks[:, 0] != picks[:, 1]).all() and (picks[:, 1] != picks[:, 2]).all()
                and (picks[:, 0] != picks[:, 2]).all())
    assert not bool(((picks == 1) | (picks == 4)).any())
    torch.manual_seed(1)
    want = torch.multinomial(weights, 3, replacement=False)
    for position in range(3):  # sequential draws: each position's marginal distribution as torch's
        assert_same_distribution(f"multinomial position {position}", picks[:, position], want[:, position])


class Recorder(torch.nn.Module):
    """A model whose forward draws from random ops and keeps the draws in buffers, so each fused
    step's draws can be read back."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        self.weight = torch.nn.Parameter(torch.ones(N))
        for i, fn in enumerate(ops.values()):
            self.register_buffer(f"draw{i}", fn(_base()).clone())

    def forward(self, x):
        total = (self.weight * x).sum()
        for i, fn in enumerate(self.ops.values()):
            value = fn(x)
            getattr(self, f"draw{i}").copy_(value)
            total = total + value.float().mean()
        return total


def test_every_random_op_draws_anew_at_every_fused_step():
    torch.manual_seed(0)
    model = Recorder(OPS)
    step = tpudist.compile_train_step(model, lambda out, _: out, torch.optim.SGD(model.parameters(), lr=0.0))
    x = _base()
    draws = []
    for _ in range(2):
        step((x, torch.zeros(N)))
        draws.append({k: v.clone() for k, v in model.state_dict().items() if k.startswith("draw")})
    for i, name in enumerate(OPS):
        a, b = draws[0][f"draw{i}"], draws[1][f"draw{i}"]
        assert not torch.equal(a, b), f"{name}: two fused steps drew the same values"

