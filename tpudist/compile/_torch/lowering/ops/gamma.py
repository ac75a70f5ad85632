"""Special functions of the gamma family: lgamma, digamma, polygamma, Hurwitz zeta and the
incomplete gamma functions.

Where JAX has the function and agrees with torch (values, NaN / inf cases) it is used; where it
does not (digamma at 0 and below, polygamma and zeta of negative arguments) the function is written
as torch's ATen/native/Math.h has it, computed in float32. torch's derivative formulas are imposed
with custom JVPs, and the derivatives torch does not implement (with respect to zeta's x, the
incomplete gammas' a) raise when asked for.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from tpudist.compile._torch.lowering._table import UnsupportedOpError, register
from tpudist.compile._torch.lowering.ops import _aten_math as aten_math
from tpudist.compile._torch.lowering.ops._util import float_arrays, in_float32, unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


_PI = np.float32(np.pi)


def _with_jvps(fn, op, *jvps):
    """`fn` of (a, x) with a JVP rule per argument; where the rule is None, differentiating that
    argument raises, as torch's "derivative not implemented" does (in torch, at backward)."""
    fn = jax.custom_jvp(fn)

    @functools.partial(fn.defjvp, symbolic_zeros=True)
    def jvp(primals, tangents):
        y = fn(*primals)
        total = jnp.zeros_like(y)
        for i, (t, rule) in enumerate(zip(tangents, jvps)):
            if type(t) is SymbolicZero:
                continue
            if rule is None:
                raise UnsupportedOpError(
                    f"torch -> XLA: {op} has no gradient with respect to its argument {i} (torch does not "
                    "implement one either); detach that input")
            total = total + rule(t, y, *primals)
        return y, total
    return fn


# -- gamma, digamma, polygamma, zeta ----------------------------------------------------------------

@jax.custom_jvp
def _lgamma(x):
    return lax.lgamma(x)


_lgamma.defjvps(lambda g, y, x: g * _digamma(x))

_PSI_A = (8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3,
          -4.16666666666666666667e-3, 3.96825396825396825397e-3, -8.33333333333333333333e-3,
          8.33333333333333333333e-2)


def _digamma_positive(x):
    # torch's float digamma: the recurrence up to 10, then the asymptotic series
    result = jnp.zeros_like(x)
    for _ in range(10):
        low = x < 10
        result = jnp.where(low, result - 1 / x, result)
        x = jnp.where(low, x + 1, x)
    z = 1 / (x * x)
    series = jnp.where(x < 1e17, z * aten_math.polevl(z, _PSI_A), 0)
    return jnp.where(x == 10, result + np.float32(2.25175258906672110764), result + jnp.log(x) - 0.5 / x - series)


@jax.custom_jvp
def _digamma(x):
    """torch's digamma: -+inf at +-0, NaN at negative integers, reflection below 0."""
    # tan(pi x) at the distance of x from its nearest integer: exact in float32 (torch computes
    # this term in float64), where pi * x is not
    r = x - jnp.round(x)
    reflected = _digamma_positive(1 - x) - _PI / jnp.tan(_PI * r)
    value = jnp.where(x < 0, jnp.where(r == 0, jnp.nan, reflected), _digamma_positive(x))
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), value)


_digamma.defjvps(lambda g, y, x: g * _trigamma(x))


@jax.custom_jvp
def _trigamma(x):
    # torch's own series (JAX's polygamma(1, x) is inf for negative x): reflection below 1/2,
    # six steps of the recurrence, then the asymptotic expansion
    reflect = x < 0.5
    s = jnp.sin(_PI * x)
    result = jnp.where(reflect, -(_PI * _PI) / (s * s), 0)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result).astype(x.dtype)


_trigamma.defjvps(lambda g, y, x: g * _polygamma(2, x))

# Euler-Maclaurin coefficients of Cephes' zeta: (2k)! / B_2k
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_EPS = float(np.finfo(np.float32).eps) / 2


def _hurwitz_zeta(x, q):
    """torch's (Cephes') Hurwitz zeta: direct summation until q + i > 9, then Euler-Maclaurin.
    Unlike JAX's zeta it sums through negative q (integer x), which polygamma of negative x needs.
    torch sums in float64; here the sum is compensated (Neumaier), as terms of opposite signs
    around the poles of negative q cancel."""

    def direct(state):
        i, a, b, s, c, done = state
        more = ~done & ((i < 9) | (a <= 9))
        a = jnp.where(more, a + 1, a)
        b = jnp.where(more, jnp.power(a, -x), b)
        t = s + b
        error = jnp.where(jnp.abs(s) >= jnp.abs(b), (s - t) + b, (b - t) + s)
        c = jnp.where(more & jnp.isfinite(t), c + error, c)
        s = jnp.where(more, t, s)
        return i + 1, a, b, s, c, done | (more & (-_EPS * (s + c) < b) & (b < _EPS * (s + c)))

    # the cases torch answers before summing (see the end) are done from the start
    early = (x <= 1) | ((q <= 0) & ((q == jnp.floor(q)) | (x != jnp.floor(x))))
    zeros = jnp.zeros_like(q)
    state = (0, q, zeros, jnp.power(q, -x), zeros, early)
    _, a, b, s, c, done = lax.while_loop(lambda st: jnp.any(~st[5] & ((st[0] < 9) | (st[1] <= 9))), direct, state)
    s, w = s + c, a
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    # torch's a = x (x + 1) ... and b = w^-(x + 2i + 1) as one product a * b, which float32 holds
    # where a and b apart would overflow and underflow; torch's a overflows float64 (x > ~7e12),
    # making a * 0 NaN, when b has underflowed
    ab, log_a, k = b, jnp.zeros_like(q), 0.0
    for coefficient in _ZETA_A:
        ab = ab * ((x + k) / w)
        log_a = log_a + jnp.log(x + k) + jnp.log(x + k + 1)
        t = jnp.where((b == 0) & (log_a > 709.78), jnp.nan, ab / coefficient)
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < _EPS)
        ab = ab * ((x + k + 1) / w)
        k += 2
    nan, inf = jnp.nan, jnp.inf
    s = jnp.where((q <= 0) & (x != jnp.floor(x)), nan, s)
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), inf, s)
    return jnp.where(x == 1, inf, jnp.where(x < 1, nan, s)).astype(q.dtype)


_zeta = _with_jvps(_hurwitz_zeta, "aten.special_zeta", None, lambda g, y, x, q: g * -x * _zeta(x + 1, q))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _polygamma(n, x):
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    factorial = float(math.factorial(n)) if n <= 170 else math.inf  # (float32 overflows from 35 on anyway)
    return (1 if n % 2 else -1) * factorial * _hurwitz_zeta(jnp.full_like(x, n + 1), x)


@_polygamma.defjvp
def _polygamma_jvp(n, primals, tangents):
    (x,), (g,) = primals, tangents
    return _polygamma(n, x), g * _polygamma(n + 1, x)


@register(aten.lgamma.default)
@in_float32
def lgamma(x):
    return _lgamma(float_arrays(x))


@register(aten.digamma.default)
@in_float32
def digamma(x):
    return _digamma(float_arrays(x))


@register(aten.polygamma.default)
@in_float32
def polygamma(n, x):
    if n < 0:
        raise unsupported_arg("aten.polygamma", f"n={n} (torch requires n >= 0)")
    return _polygamma(n, float_arrays(x))


@register(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
@in_float32
def zeta(x, q):
    return _zeta(*float_arrays(x, q))


def _igamma_edges(a, x, value, lower):
    """torch's boundary values (from SciPy): NaN off the domain; 0, 1 at the ends."""
    one, zero = (1.0, 0.0) if lower else (0.0, 1.0)
    value = jnp.where(jnp.isinf(x), one, value)
    value = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), jnp.nan, zero), value)
    value = jnp.where(x == 0, zero, value)
    value = jnp.where(a == 0, jnp.where(x > 0, one, jnp.nan), value)
    return jnp.where((x < 0) | (a < 0), jnp.nan, value).astype(value.dtype)


def _igamma_dx(a, x):
    return jnp.exp((a - 1) * jnp.log(x) - x - lax.lgamma(a))


def _igamma(a, x):
    return _igamma_edges(a, x, lax.igamma(a, x), lower=True)


def _igammac(a, x):
    return _igamma_edges(a, x, lax.igammac(a, x), lower=False)


_igamma = _with_jvps(_igamma, "aten.igamma", None, lambda g, y, a, x: g * _igamma_dx(a, x))
_igammac = _with_jvps(_igammac, "aten.igammac", None, lambda g, y, a, x: -g * _igamma_dx(a, x))


@register(aten.igamma.default)
@in_float32
def igamma(a, x):
    return _igamma(*float_arrays(a, x))


@register(aten.igammac.default)
@in_float32
def igammac(a, x):
    return _igammac(*float_arrays(a, x))
