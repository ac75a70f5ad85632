"""Special functions: the error-function family, Bessel and Airy functions, the orthogonal
polynomials (the gamma family is in `gamma`).

Where JAX has the function and agrees with torch (values, NaN / inf cases) it is used; where it
does not (erfcx, the Bessel functions of the second kind, the polynomials, ...) the function is
written as torch's ATen/native/Math.h has it, here or in `_aten_math`, computed in float32. torch's
derivative formulas are imposed with custom JVPs where autodiff of the forward would differ from
them; the functions torch does not differentiate pass no gradient (their inputs are constants to
autograd, as in torch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering.ops import _aten_math as aten_math
from tpudist.compile._torch.lowering.ops._util import float_arrays, in_float32
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _constant(fn):
    """A function torch does not differentiate: its inputs are constants to autograd."""
    @functools.wraps(fn)
    def wrapped(*args):
        return fn(*(lax.stop_gradient(a) if hasattr(a, "dtype") else a for a in args))
    return in_float32(wrapped)


# -- the error-function family ----------------------------------------------------------------------

@jax.custom_jvp
def _erfinv(y):
    # XLA's erf_inv is a few ulp off, which exp(erfinv(y)^2) in the derivative magnifies near +-1:
    # one Newton step refines it, with the residual erf(x) - y taken as (1 - |y|) - erfc(|x|) in
    # the tails, where 1 - |y| is exact and erfc keeps its relative precision
    x = lax.erf_inv(y)
    tail = jnp.abs(y) > 0.5
    residual = jnp.where(tail, jnp.sign(y) * ((1 - jnp.abs(y)) - lax.erfc(jnp.abs(x))), lax.erf(x) - y)
    refined = x - residual / (np.float32(2 / np.sqrt(np.pi)) * jnp.exp(-x * x))
    return jnp.where(jnp.isfinite(x), refined, x)


_erfinv.defjvps(lambda g, x, y: g * np.float32(np.sqrt(np.pi) / 2) * jnp.exp(x * x))  # x = erfinv(y)

# (1 + 2a) erfcx(a) - 1 as a Chebyshev series in q = (a - 2) / (a + 2), a >= 0: fitted here to
# torch's float64 erfcx (error 5e-10); JAX's erfcx underflows to 0 near a = 9.2
_ERFCX_CHEB = (1.7600665559e-01, 2.5779673870e-02, -1.0659315068e-01, 3.8808879574e-02, -5.4148999309e-03,
               -4.0815257282e-04, 1.9843768248e-04, 9.8425326899e-06, -7.7632658023e-06, -7.1739971100e-07,
               3.1407427460e-07, 6.1892263422e-08, -9.9392972552e-09, -4.8583613744e-09)


@jax.custom_jvp
def _erfcx(x):
    a = jnp.abs(x)
    q = 1 - 4 / (a + 2)
    b1, b2 = jnp.zeros_like(q), jnp.zeros_like(q)
    for c in _ERFCX_CHEB[:0:-1]:
        b1, b2 = 2 * q * b1 - b2 + c, b1
    positive = (1 + (q * b1 - b2 + _ERFCX_CHEB[0])) / (1 + 2 * a)
    # x < 0 as torch: erfcx(x) = 2 exp(x^2) - erfcx(-x), its first term alone below -6.1
    e = 2 * jnp.exp(x * x)
    negative = jnp.where(x < -26.7, jnp.inf, jnp.where(x < -6.1, e, e - positive))
    return jnp.where(x < 0, negative, positive)


_erfcx.defjvps(lambda g, y, x: g * (2 * x * y - np.float32(2 / np.sqrt(np.pi))))


@jax.custom_jvp
def _ndtri(p):
    return jss.ndtri(p)


_ndtri.defjvps(lambda g, y, p: g * np.float32(np.sqrt(2 * np.pi)) * jnp.exp(y * y / 2))


@jax.custom_jvp
def _log_ndtr(x):
    t = x * np.float32(np.sqrt(0.5))
    return jnp.where(x < -1, jnp.log(_erfcx(-t) / 2) - t * t, jnp.log1p(-lax.erfc(t) / 2))


_log_ndtr.defjvps(lambda g, y, x: g * np.float32(1 / np.sqrt(2 * np.pi)) * jnp.exp(-(y + x * x / 2)))


@register(aten.erfinv.default)
@in_float32
def erfinv(x):
    return _erfinv(float_arrays(x))


@register(aten.erfc.default)
@in_float32
def erfc(x):
    return lax.erfc(float_arrays(x))


@register(aten.special_erfcx.default)
@in_float32
def erfcx(x):
    return _erfcx(float_arrays(x))


@register(aten.special_log_ndtr.default)
@in_float32
def log_ndtr(x):
    # torch's kernel and its derivative (torch.export's decomposition, a where() of two
    # branches, differentiates to NaN for |x| beyond ~5: kept whole below)
    return _log_ndtr(float_arrays(x))


keep_whole(aten.special_log_ndtr.default)


@register(aten.special_ndtri.default)
@in_float32
def ndtri(x):
    return _ndtri(float_arrays(x))


# -- Bessel and Airy functions ----------------------------------------------------------------------

@jax.custom_jvp
def _i0(x):
    return jss.i0(x)


@jax.custom_jvp
def _i1(x):
    return jss.i1(x)


@jax.custom_jvp
def _i1e(x):
    return jss.i1e(x)


def _i1_slope(x, y, scaled):
    # torch's derivative of i1 (i1e), with its value 1/2 at |x| <= eps (NaN included)
    tiny = ~(jnp.abs(x) > np.finfo(np.float32).eps)
    safe = jnp.where(tiny, np.finfo(np.float32).eps, x)
    slope = jss.i0e(safe) - y * (jnp.sign(safe) + 1 / safe) if scaled else jss.i0(safe) - y / safe
    return jnp.where(tiny, 0.5, slope)


# autodiff of JAX's exp(|x|) i0e(x) cancels two large terms; torch's derivative is i1
_i0.defjvps(lambda g, y, x: g * jss.i1(x))
_i1.defjvps(lambda g, y, x: g * _i1_slope(x, y, scaled=False))
_i1e.defjvps(lambda g, y, x: g * _i1_slope(x, y, scaled=True))

for _op, _fn in [(aten.i0.default, _i0), (aten.special_i0e.default, jss.i0e),
                 (aten.special_i1.default, _i1), (aten.special_i1e.default, _i1e)]:
    register(_op)(in_float32(lambda x, fn=_fn: fn(float_arrays(x))))


def _torch_differentiates(name: str) -> bool:
    """Whether the running torch has a derivative for torch.special.NAME (2.15 added the Bessel
    functions'; before, their inputs are constants to autograd, and must be here too)."""
    import torch
    fn = getattr(torch.special, name, None)
    return fn is not None and fn(torch.ones(1, requires_grad=True)).requires_grad


def _k(order):
    return lambda x: aten_math.k(x, order, scaled=False)


# (op, torch.special's name, the function, its derivative from (x, value) as torch 2.15 has it)
_BESSEL = [
    (aten.special_bessel_j0.default, "bessel_j0", aten_math.j0, lambda x, y: -aten_math.j1(x)),
    (aten.special_bessel_j1.default, "bessel_j1", aten_math.j1,
     lambda x, y: jnp.where(x == 0, 0.5, aten_math.j0(x) - y / x)),
    (aten.special_bessel_y0.default, "bessel_y0", aten_math.y0, lambda x, y: -aten_math.y1(x)),
    (aten.special_bessel_y1.default, "bessel_y1", aten_math.y1,
     lambda x, y: jnp.where(x == 0, jnp.inf, aten_math.y0(x) - y / x)),
    (aten.special_modified_bessel_i0.default, "modified_bessel_i0", jss.i0, lambda x, y: jss.i1(x)),
    (aten.special_modified_bessel_i1.default, "modified_bessel_i1", jss.i1,
     lambda x, y: _i1_slope(x, y, scaled=False)),
    (aten.special_modified_bessel_k0.default, "modified_bessel_k0", _k(0), lambda x, y: -_k(1)(x)),
    (aten.special_modified_bessel_k1.default, "modified_bessel_k1", _k(1), lambda x, y: -_k(0)(x) - y / x),
]
for _op, _name, _fn, _slope in _BESSEL:
    if _torch_differentiates(_name):
        _fn = jax.custom_jvp(_fn)
        _fn.defjvps(lambda g, y, x, slope=_slope: g * slope(x, y))
        register(_op)(in_float32(lambda x, fn=_fn: fn(float_arrays(x)).astype(float_arrays(x).dtype)))
    else:
        register(_op)(_constant(lambda x, fn=_fn: fn(float_arrays(x)).astype(float_arrays(x).dtype)))

for _op, _fn in [
    (aten.special_scaled_modified_bessel_k0.default, lambda x: aten_math.k(x, 0, scaled=True)),
    (aten.special_scaled_modified_bessel_k1.default, lambda x: aten_math.k(x, 1, scaled=True)),
    (aten.special_airy_ai.default, aten_math.airy_ai),
    (aten.special_spherical_bessel_j0.default, aten_math.spherical_j0),
]:
    register(_op)(_constant(lambda x, fn=_fn: fn(float_arrays(x)).astype(float_arrays(x).dtype)))


# -- orthogonal polynomials: (x, n) of tensors or one scalar -----------------------------------------

def _polynomial(name, fn):
    packet = getattr(aten, f"special_{name}")
    register(packet.default, packet.x_scalar, packet.n_scalar)(_constant(lambda x, n: fn(*float_arrays(x, n))))


for _kind in "tuvw":
    _polynomial(f"chebyshev_polynomial_{_kind}", functools.partial(aten_math.chebyshev, _kind, shifted=False))
    _polynomial(f"shifted_chebyshev_polynomial_{_kind}", functools.partial(aten_math.chebyshev, _kind, shifted=True))
_polynomial("hermite_polynomial_h", functools.partial(aten_math.hermite, physicists=True))
_polynomial("hermite_polynomial_he", functools.partial(aten_math.hermite, physicists=False))
_polynomial("laguerre_polynomial_l", aten_math.laguerre)
_polynomial("legendre_polynomial_p", aten_math.legendre)
