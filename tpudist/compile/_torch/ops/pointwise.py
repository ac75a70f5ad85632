"""Elementwise ops: arithmetic, comparisons, logic, activations, casts, floating-point manipulation
(copysign, nextafter, frexp, ldexp, ...), complex numbers, integer ops (gcd, lcm, shifts).

Result dtypes need no care here: the interpreter casts every result to the dtype torch recorded
for that node, so `int32 / int32` and friends come out as torch would have them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch._custom_ops import STOP_GRADIENT
from tpudist.compile._torch._registry import keep_whole, register
from tpudist.compile._torch.ops._util import in_float32

aten = __import__("torch").ops.aten


def _scaled(y, alpha):
    return y if alpha is None or alpha == 1 else y * alpha


@register(aten.add.Tensor, aten.add.Scalar)
def add(x, y, alpha=1):
    return x + _scaled(y, alpha)


@register(aten.sub.Tensor, aten.sub.Scalar)
def sub(x, y, alpha=1):
    return x - _scaled(y, alpha)


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(x, y, alpha=1):
    return y - _scaled(x, alpha)


@register(aten.mul.Tensor, aten.mul.Scalar)
def mul(x, y):
    return x * y


@register(aten.div.Tensor, aten.div.Scalar)
def div(x, y):
    return jnp.true_divide(x, y)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(x, y, rounding_mode=None):
    if rounding_mode == "floor":
        return jnp.floor_divide(x, y)
    if rounding_mode == "trunc":
        if all(jnp.issubdtype(jnp.result_type(v), jnp.integer) for v in (x, y)):
            # C's integer division, exact and rounding toward zero, as torch's (where float
            # division would round, and |x| overflow at the minimum)
            dtype = jnp.result_type(x, y)
            return lax.div(*jnp.broadcast_arrays(jnp.asarray(x, dtype), jnp.asarray(y, dtype)))
        return jnp.trunc(jnp.true_divide(x, y))
    return jnp.true_divide(x, y)


@register(aten.remainder.Tensor, aten.remainder.Scalar)
def remainder(x, y):
    return jnp.remainder(x, y)


@register(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(x, y):
    return jnp.fmod(x, y)


@register(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(x, exponent):
    # an integral exponent lowers to repeated multiplication: exact, defined for negative bases
    if isinstance(exponent, float) and exponent.is_integer():
        exponent = int(exponent)
    return lax.integer_pow(x, exponent) if isinstance(exponent, int) else jnp.power(x, exponent)


@register(aten.pow.Tensor_Tensor)
def pow_tensor_tensor(x, exponent):
    return jnp.power(x, exponent)


@register(aten.pow.Scalar)
def pow_scalar(base, exponent):
    return jnp.power(base, exponent)


def _sign(x):
    # torch's sign of NaN is 0; it has no gradient
    return lax.stop_gradient(jnp.where(jnp.isnan(x), 0, jnp.sign(x)))


def _unary(op, fn):
    register(op)(lambda x: fn(x))


for _op, _fn in [
    (aten.neg.default, jnp.negative), (aten.sign.default, _sign),
    (aten.exp.default, jnp.exp), (aten.exp2.default, jnp.exp2), (aten.expm1.default, jnp.expm1),
    (aten.log.default, jnp.log), (aten.log2.default, jnp.log2), (aten.log10.default, jnp.log10),
    (aten.log1p.default, jnp.log1p), (aten.sqrt.default, jnp.sqrt), (aten.rsqrt.default, lax.rsqrt),
    (aten.reciprocal.default, jnp.reciprocal), (aten.sin.default, jnp.sin), (aten.cos.default, jnp.cos),
    (aten.tan.default, jnp.tan), (aten.asin.default, jnp.arcsin), (aten.acos.default, jnp.arccos),
    (aten.atan.default, jnp.arctan), (aten.sinh.default, jnp.sinh), (aten.cosh.default, jnp.cosh),
    (aten.tanh.default, jnp.tanh), (aten.erf.default, lax.erf),
    (aten.asinh.default, jnp.arcsinh), (aten.acosh.default, jnp.arccosh), (aten.atanh.default, jnp.arctanh),
    (aten.floor.default, jnp.floor), (aten.ceil.default, jnp.ceil), (aten.round.default, jnp.round),
    (aten.trunc.default, jnp.trunc), (aten.sigmoid.default, jax.nn.sigmoid),
    (aten.relu.default, jax.nn.relu), (aten.silu.default, jax.nn.silu),
    (aten.isnan.default, jnp.isnan), (aten.isinf.default, jnp.isinf),
    (aten.logical_not.default, jnp.logical_not), (aten.bitwise_not.default, jnp.invert),
    # the graph is functional once captured: these only name a value again
    (aten.clone.default, lambda x: x), (aten.alias.default, lambda x: x),
    (aten.lift_fresh_copy.default, lambda x: x),
    (aten.detach.default, lax.stop_gradient), (STOP_GRADIENT, lax.stop_gradient),
]:
    _unary(_op, _fn)


@register(aten.abs.default)
def abs_(x):
    if jnp.iscomplexobj(x):
        return jnp.abs(x)
    # x * sign(x): the same values, and torch's gradient sign(x): zero at 0 (jnp.abs passes one) and NaN
    return x * _sign(x)


def _compare(op, fn):
    register(*op)(lambda x, y: fn(x, y))


for _ops, _fn in [
    ((aten.eq.Tensor, aten.eq.Scalar), jnp.equal), ((aten.ne.Tensor, aten.ne.Scalar), jnp.not_equal),
    ((aten.lt.Tensor, aten.lt.Scalar), jnp.less), ((aten.le.Tensor, aten.le.Scalar), jnp.less_equal),
    ((aten.gt.Tensor, aten.gt.Scalar), jnp.greater), ((aten.ge.Tensor, aten.ge.Scalar), jnp.greater_equal),
    ((aten.logical_and.default,), jnp.logical_and), ((aten.logical_or.default,), jnp.logical_or),
    ((aten.logical_xor.default,), jnp.logical_xor),
    ((aten.bitwise_and.Tensor, aten.bitwise_and.Scalar), jnp.bitwise_and),
    ((aten.bitwise_or.Tensor, aten.bitwise_or.Scalar), jnp.bitwise_or),
    ((aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar), jnp.bitwise_xor),
    ((aten.minimum.default,), jnp.minimum), ((aten.maximum.default,), jnp.maximum),
    ((aten.atan2.default,), jnp.arctan2),
]:
    _compare(_ops, _fn)


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition, x, y):
    return jnp.where(condition, x, y)


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


@register(aten.clamp.default, aten.clamp.Tensor)
def clamp(x, min=None, max=None):
    # selects rather than min/max, so that at the bounds the gradient passes in full, as in torch;
    # a NaN in x or in a bound gives NaN, and no gradient to it (torch's masks compare false)
    def bound(y, b, beyond):
        b = jnp.asarray(b, x.dtype)
        return jnp.where(beyond(y, b), b, jnp.where(jnp.isnan(b), lax.stop_gradient(b), y))

    y = x if min is None else bound(x, min, jnp.less)
    y = y if max is None else bound(y, max, jnp.greater)
    return jnp.where(jnp.isnan(x), lax.stop_gradient(x), y)


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(x, min):
    return clamp(x, min=min)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(x, max):
    return clamp(x, max=max)


@register(aten.gelu.default)
def gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@register(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@register(aten.hardtanh.default)
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return clamp(x, min_val, max_val)


@register(aten.elu.default)
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    # expm1 of the clamped input: the branch where() discards must not overflow, or its
    # infinite gradient times zero would poison the result with NaN
    negative = alpha * jnp.expm1(jnp.minimum(x, 0) * input_scale)
    return scale * jnp.where(x > 0, x, negative)


@register(aten.hardsigmoid.default)
def hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@register(aten.hardswish.default)
def hardswish(x):
    return x * jnp.clip(x + 3, 0, 6) / 6


@register(aten._to_copy.default)
def to_copy(x, dtype=None, non_blocking=False):
    return x if dtype is None else x.astype(dtype)


@register(__import__("torch").ops.prims.convert_element_type.default)
def convert_element_type(x, dtype):
    # a cast some of torch's own decompositions emit (renorm in bfloat16)
    return x.astype(dtype)


@register(aten.copy.default)
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(jnp.asarray(src).astype(x.dtype), x.shape)


@register(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, value, x.dtype)


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
        return _sign(x)
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
    _unary(_op, _fn)


# -- integers ---------------------------------------------------------------------------------------

@register(aten.gcd.default)
def gcd(x, y):
    return jnp.gcd(x, y)


@register(aten.lcm.default)
def lcm(x, y):
    # torch's |x / gcd * y| in C's int arithmetic: narrower integers widened to int32 first, int32
    # wrapping before the abs (jnp.lcm takes the abs first)
    x, y = (jnp.asarray(v, jnp.promote_types(jnp.result_type(x, y), jnp.int32)) for v in (x, y))
    g = jnp.gcd(x, y)
    return jnp.where(g == 0, 0, jnp.abs(x // jnp.where(g == 0, 1, g) * y))


# XLA's shifts give torch's answers for counts outside [0, bits): 0 to the left, the sign to the right
@register(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
          aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)
def left_shift(x, y):
    return jnp.left_shift(x, y)


@register(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
          aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)
def right_shift(x, y):
    return jnp.right_shift(x, y)
