"""Floating-point manipulation (copysign, nextafter, frexp, ldexp, ...) and complex numbers, with
torch's gradients where JAX's autodiff gives others (at 0, at the origin, at infinities).

As in `pointwise`, result dtypes need no care: the interpreter casts every result to the dtype
torch recorded for that node.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering.ops._util import in_float32, register_unary, torch_sign
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


# -- floating-point manipulation --------------------------------------------------------------------

def _floats(*xs):
    """The arguments in their common dtype, float32 if that is integral (torch's int-to-float ops)."""
    dtype = jnp.result_type(*xs)
    dtype = dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32
    return [jnp.asarray(x, dtype) for x in xs]


@jax.custom_jvp
def _copysign(x, y):
    return jnp.copysign(x, y)


# torch's derivative: result / x (NaN at infinities), 0 at x = 0; none to y
_copysign.defjvps(lambda g, z, x, y: g * jnp.where(x == 0, 0, z / x), None)


@register(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(x, y):
    return _copysign(*jnp.broadcast_arrays(*_floats(x, y)))


@register(aten.signbit.default)
def signbit(x):
    return jnp.zeros(x.shape, bool) if x.dtype == jnp.bool_ else jnp.signbit(x)


@jax.custom_jvp
def _hypot(x, y):
    return jnp.hypot(x, y)


# torch's derivative, x / hypot(x, y): NaN at (0, 0), where JAX's passes 1/2 to each
_hypot.defjvps(lambda g, r, x, y: g * x / r, lambda g, r, x, y: g * y / r)


@register(aten.hypot.default)
@in_float32
def hypot(x, y):
    return _hypot(*jnp.broadcast_arrays(*_floats(x, y)))


@jax.custom_jvp
def _nextafter(x, y):
    return jnp.nextafter(x, y)


_nextafter.defjvps(lambda g, z, x, y: jnp.where(x != y, g, 0), None)  # torch's: to x unless x == y


@register(aten.nextafter.default)
def nextafter(x, y):
    return _nextafter(*jnp.broadcast_arrays(x, y))


def _select_nan_ignoring(take_x, x, y):
    # a select rather than jnp.fmax: ties pass the whole gradient to x, as torch's fmax / fmin
    return jnp.where(take_x | jnp.isnan(y), x, y)


@register(aten.fmax.default)
def fmax(x, y):
    return _select_nan_ignoring(x >= y, x, y)


@register(aten.fmin.default)
def fmin(x, y):
    return _select_nan_ignoring(x <= y, x, y)


@jax.custom_jvp
def _ldexp_integer(x, other):
    return x * jnp.power(jnp.asarray(2, x.dtype), other.astype(x.dtype))


# torch's derivative, grad * pow(2, other), takes the power in the exponent's integer dtype:
# 0 for negative exponents, wrapping at the top (a shift gives both)
_ldexp_integer.defjvps(lambda g, y, x, other: g * jnp.left_shift(jnp.ones_like(other), other).astype(g.dtype), None)


@register(aten.ldexp.Tensor)
def ldexp(x, other):
    # torch's ldexp: x * 2.0 ** other (so an infinite product where x * 2^other would be finite)
    if jnp.issubdtype(jnp.result_type(other), jnp.integer):
        x = _floats(x)[0]
        return _ldexp_integer(*jnp.broadcast_arrays(x, jnp.asarray(other)))
    x, other = _floats(x, other)
    return x * jnp.power(jnp.asarray(2, other.dtype), other)


@jax.custom_jvp
def _frexp(x):
    return jnp.frexp(x)


@_frexp.defjvp
def _frexp_jvp(primals, tangents):
    (x,), (g,) = primals, tangents
    mantissa, exponent = jnp.frexp(x)
    # torch: the mantissa's gradient is grad / 2^exponent; the exponent has none
    scale = jnp.ldexp(jnp.ones_like(x), -exponent)
    return (mantissa, exponent), (g * scale, jnp.zeros(exponent.shape, jax.dtypes.float0))


@register(aten.frexp.Tensor)
def frexp(x):
    return _frexp(x)


@register(aten.round.decimals)
@in_float32
def round_decimals(x, decimals=0):
    # torch's kernel: scale by 10^|decimals| (rounded to the dtype), round half to even, unscale
    scale = jnp.asarray(10.0 ** abs(decimals), x.dtype)
    if decimals < 0:
        return jnp.round(x / scale) * scale
    return jnp.round(x * scale) / scale


# -- complex numbers --------------------------------------------------------------------------------

@register(aten.angle.default)
def angle(x):
    if jnp.iscomplexobj(x):
        # torch's gradient is 0 at 0, where atan2's is NaN
        re, im = jnp.real(x), jnp.imag(x)
        zero = (re == 0) & (im == 0)
        safe = jnp.arctan2(jnp.where(zero, 0, im), jnp.where(zero, 1, re))
        return jnp.where(zero, lax.stop_gradient(jnp.arctan2(im, re)), safe)
    # a real number's angle, pi below zero (NaN stays NaN), has no gradient in torch
    x = lax.stop_gradient(_floats(x)[0])
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


@register(aten.sgn.default)
def sgn(x):
    # kept whole (below): torch.export's decomposition, where(|x| == 0, 0, x / |x|), differentiates
    # to NaN at 0 (0 / 0 in the branch it drops); torch's gradient there is 0
    if not jnp.iscomplexobj(x):
        return torch_sign(x)
    magnitude = jnp.abs(x)
    zero = magnitude == 0
    return jnp.where(zero, 0, x / jnp.where(zero, 1, magnitude))


keep_whole(aten.sgn.default)


@register(aten.complex.default)
def complex_(real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@register(aten.polar.default)
def polar(magnitude, angle_):
    return lax.complex(*jnp.broadcast_arrays(magnitude * jnp.cos(angle_), magnitude * jnp.sin(angle_)))


@register(aten.view_as_complex.default)
def view_as_complex(x):
    return lax.complex(x[..., 0], x[..., 1])


@register(aten.view_as_real.default)
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


for _op, _fn in [(aten.real.default, jnp.real), (aten.imag.default, jnp.imag),
                 (aten._conj.default, jnp.conj), (aten.conj_physical.default, jnp.conj),
                 (aten._conj_physical.default, jnp.conj)]:
    register_unary(_op, _fn)
