"""Special functions and the rest of the elementwise family through `tpudist.compile`, against
eager torch, on what torch's OpInfo samples do not reach: zeros of either sign, infinities, NaN,
negative arguments near poles, the ends of the polynomials' domains and their high degrees, ties,
integer edge values, complex intermediates, and the gradients torch does not implement."""

from __future__ import annotations

import pytest
import torch

import tpudist
from tpudist.compile import UnsupportedOpError

from compiled_check import Fn, leaves

# torch.export's own deprecation noise, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

NAN, INF = float("nan"), float("inf")
S = torch.special
EDGES = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 1e-30, -1e-30, 5.0, 8.0, 30.0, -30.0, 1e4, -1e4, 1e30, -1e30,
         INF, -INF, NAN, -2.09, 2.09, 8.3203353, 26.8, -26.8, 6.2, -6.2, 9.2, -9.2, 0.99999994, -0.99999994]


def values(low=-12.0, high=12.0, n=193):
    return torch.cat([torch.linspace(low, high, n), torch.tensor(EDGES)])


def _assert_close(what, got, want, exact):
    """`got` as close to float64 torch (`exact`) as float32 torch (`want`) is, elementwise, up to
    4x and a few ulp; NaN, infinities and integers exactly where torch has them."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (what, got.dtype, got.shape, want.dtype, want.shape)
    if not (want.is_floating_point() or want.is_complex()):
        assert torch.equal(got, want), (what, got, want)
        return
    if want.is_complex():
        got, want, exact = (torch.view_as_real(t) for t in (got, want, exact))
    got, want, exact = got.double(), want.double(), exact.double()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        bad = (test(got) != test(want)).nonzero().flatten().tolist()
        assert not bad, f"{what}: {test.__name__} differs at {bad[:5]}: {got[bad[:5]]} vs torch {want[bad[:5]]}"
    finite = torch.isfinite(want) & torch.isfinite(exact)
    g, w, x = got[finite], want[finite], exact[finite]
    bad = ((g - x).abs() > 4 * (w - x).abs() + 4e-6 * x.abs() + 1e-6).nonzero().flatten().tolist()
    assert not bad, f"{what}: values differ at {bad[:5]}: {g[bad[:5]]} vs torch {w[bad[:5]]} (float64 {x[bad[:5]]})"


def check(fn, *inputs, grad=True):
    """fn through tpudist.compile against eager torch in float32 and float64: every output, and
    with `grad` the floating inputs' gradients of a random projection of the differentiable outputs."""
    def run(module, dtype):
        xs = [t.detach().to(dtype if t.is_floating_point() else t.dtype).requires_grad_(grad and t.is_floating_point())
              for t in inputs]
        outs = leaves(module(*xs))
        gen = torch.Generator().manual_seed(0)
        reals = [torch.view_as_real(o) if o.is_complex() else o for o in outs if o.requires_grad]
        loss = sum((r * torch.randn(r.shape, generator=gen, dtype=r.dtype)).sum() for r in reals)
        grads = []
        if grad and isinstance(loss, torch.Tensor):
            loss.backward()
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs if x.requires_grad]
        return [o.detach() for o in outs], grads

    got, want, exact = run(tpudist.compile(Fn(fn)), torch.float32), run(fn, torch.float32), run(fn, torch.float64)
    for kind, i in ((0, "output"), (1, "gradient")):
        assert len(got[kind]) == len(want[kind])
        for j, (g, w, x) in enumerate(zip(got[kind], want[kind], exact[kind])):
            _assert_close(f"{i} {j}", g, w, x.to(w.dtype) if not w.is_floating_point() else x)


def test_gamma_family_values_and_gradients_at_poles_zeros_and_infinities():
    x = values()
    check(lambda x: (torch.lgamma(x), torch.digamma(x), torch.polygamma(1, x), torch.polygamma(2, x),
                     torch.polygamma(3, x), torch.mvlgamma(x.clamp(min=2.5), 4)), x)


def test_zeta_and_incomplete_gamma_edges():
    x, q = values(-4, 14, 91), values(-12, 12, 91).flip(0)
    check(lambda x, q: (S.zeta(x, q), S.zeta(x, 2.5), S.zeta(x.round(), -2.5), S.zeta(3.0, q),
                        torch.igamma(x, q), torch.igammac(x, q), torch.igamma(x.abs(), q.abs())), x, q, grad=False)
    # zeta's derivative in q, igamma's in x: torch's formulas
    check(lambda q: (S.zeta(4.0, q), torch.igamma(torch.full_like(q, 2.5), q), torch.igammac(torch.ones_like(q), q)),
          torch.linspace(0.25, 9, 40))


def test_error_function_family_tails():
    x = values(-12, 12, 241)
    check(lambda x: (torch.erfc(x), S.erfcx(x), torch.erfinv(x.clamp(-1, 1)), S.ndtri(x.clamp(0, 1))), x)
    # log_ndtr through torch's decomposition (erfcx and erfc in a where)
    check(S.log_ndtr, x, grad=False)
    check(S.log_ndtr, torch.linspace(-4.5, 4.5, 91))
    # erfinv's gradient near +-1, where exp(erfinv(y)^2) magnifies the forward's error
    check(torch.erfinv, torch.cat([1 - torch.logspace(-7, -1, 50), torch.logspace(-7, -1, 50) - 1]))


def test_bessel_and_airy_functions():
    x = values(-30, 30, 241)
    check(lambda x: (torch.i0(x), S.i0e(x), S.i1(x), S.i1e(x)), x)
    check(lambda x: (S.bessel_j0(x), S.bessel_j1(x), S.bessel_y0(x), S.bessel_y1(x), S.modified_bessel_i0(x),
                     S.modified_bessel_i1(x), S.modified_bessel_k0(x), S.modified_bessel_k1(x),
                     S.scaled_modified_bessel_k0(x), S.scaled_modified_bessel_k1(x), S.spherical_bessel_j0(x),
                     S.airy_ai(x.clamp(max=10.0)), S.airy_ai(x / 3)), x, grad=False)


def test_orthogonal_polynomials_ends_high_degrees_and_odd_degrees():
    # (no NaN x: from degree 2 most of torch's kernels return an uninitialized value for it)
    x = torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.3, 0.999, 1.5, -2.0, 3.0, -INF, INF, 0.75, 1e-8]).repeat_interleave(10)
    n = torch.tensor([-1.0, 0.0, 1.0, 2.0, 3.7, 5.0, 9.0, 15.0, 20.0, NAN]).repeat(13)
    fns = [S.chebyshev_polynomial_t, S.chebyshev_polynomial_u, S.chebyshev_polynomial_v, S.chebyshev_polynomial_w,
           S.shifted_chebyshev_polynomial_t, S.shifted_chebyshev_polynomial_u, S.shifted_chebyshev_polynomial_v,
           S.shifted_chebyshev_polynomial_w, S.hermite_polynomial_h, S.hermite_polynomial_he,
           S.laguerre_polynomial_l, S.legendre_polynomial_p]
    check(lambda x, n: [f(x, n) for f in fns] + [f(x, 4) for f in fns] + [f(0.5, n) for f in fns], x, n, grad=False)
    # beyond Hermite's float32 limit (NaN), closed forms of huge degrees, their parity at -1
    x, n = torch.tensor([-1.0, 0.3, -0.7, 0.0, 1.0, NAN]), torch.tensor([1e10 + 1, 12.0, 129.0, 7e9, 3e9, 5.0])
    check(lambda x, n: [f(x, n) for f in fns[:8]] + [fns[0](x, 3), fns[8](x, n), fns[9](x, n)],
          x[:5], n[:5], grad=False)
    check(lambda x, n: [fns[0](x, n), fns[8](x, n), fns[9](x, n)], x, n, grad=False)


def test_gradients_torch_does_not_implement_raise():
    q, a = torch.linspace(1, 3, 5), torch.linspace(1, 3, 5).requires_grad_()
    for fn in (lambda a, q: S.zeta(a, q), lambda a, q: torch.igamma(a, q), lambda a, q: torch.igammac(a, q)):
        with pytest.raises(UnsupportedOpError, match="no gradient with respect to its argument 0"):
            tpudist.compile(Fn(fn))(a, q)


def test_floating_point_manipulation_nan_ties_and_signed_zeros():
    x = torch.tensor([0.0, -0.0, 1.5, -1.5, INF, -INF, NAN, 3e30, 2.0, 1e-3, -7.25, 0.5])
    y = torch.tensor([-0.0, 0.0, -2.0, 2.0, 1.0, NAN, 1.0, -1.0, 2.0, NAN, -7.25, INF])
    check(lambda x, y: (torch.copysign(x, y), torch.copysign(x, -1.0), torch.fmax(x, y), torch.fmin(x, y),
                        torch.hypot(x, y), torch.nextafter(x, y), torch.signbit(x), torch.sign(x), torch.abs(x),
                        torch.angle(x), torch.frexp(x), torch.ldexp(x, torch.arange(12) - 6),
                        torch.round(x * 123.456, decimals=2), torch.round(x * 1234.5, decimals=-2),
                        torch.clamp(x, min=-1.0, max=2.0), torch.clamp(x, min=y), torch.clamp(x, max=y)), x, y)


def test_integer_elementwise_ops():
    a = torch.tensor([12, -18, 0, 7, -5, 2**31 - 1, -2**31, 100], dtype=torch.int32)
    b = torch.tensor([8, 12, 0, -3, 0, 6, 4, -33], dtype=torch.int32)
    s = torch.tensor([1, 3, 0, 31, 33, 2, 5, -1], dtype=torch.int32)
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        check(lambda a, b, s: (torch.gcd(a, b), torch.lcm(a, b), a << s, a >> s, a << 3, a >> 2,
                               torch.bitwise_left_shift(a, s), torch.bitwise_right_shift(a, s),
                               torch.signbit(a), torch.copysign(a, b), torch.angle(a), torch.sign(a),
                               torch.div(a, b.masked_fill(b == 0, 1), rounding_mode="trunc")),
              a.to(dtype), b.to(dtype), s.to(dtype))


def test_complex_intermediates_values_and_gradients():
    # rotary embeddings' view_as_complex -> multiply -> view_as_real, and complex built and
    # reduced again inside the graph: JAX's gradients through complex values agree with torch's
    x, angle = torch.randn(4, 6, 2), torch.randn(4, 6)

    def fn(x, angle):
        rotated = torch.view_as_real(torch.view_as_complex(x) * torch.polar(torch.ones_like(angle), angle))
        z = torch.complex(x[..., 0], angle)
        return (rotated, z.abs(), z.angle(), torch.view_as_real(z.conj() * z.sgn()), (z * z).real, z.imag,
                z * z, torch.polar(x[..., 0].abs(), angle))  # (complex outputs: gradients cross to torch)

    check(fn, x, angle)
