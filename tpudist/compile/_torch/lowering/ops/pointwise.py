"""Elementwise ops: arithmetic, comparisons, logic, activations, casts, integer ops (gcd, lcm,
shifts); floating-point manipulation and complex numbers are in `floating`.

Result dtypes need no care here: the interpreter casts every result to the dtype torch recorded
for that node, so `int32 / int32` and friends come out as torch would have them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpudist.compile._torch._custom_ops import STOP_GRADIENT
from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import register_unary, torch_sign
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


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


for _op, _fn in [
    (aten.neg.default, jnp.negative), (aten.sign.default, torch_sign),
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
    register_unary(_op, _fn)


@register(aten.abs.default)
def abs_(x):
    if jnp.iscomplexobj(x):
        return jnp.abs(x)
    # x * sign(x): the same values, and torch's gradient sign(x): zero at 0 (jnp.abs passes one) and NaN
    return x * torch_sign(x)


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


def clamp(x, min=None, max=None, at_min=1.0, at_max=1.0):
    # selects rather than min/max; where x equals a bound, x gets the share `at_min` / `at_max` of
    # the gradient and the bound the rest, as the running torch splits it; a NaN in x or in a bound
    # gives NaN, and no gradient to it (torch's masks compare false)
    def bound(y, b, beyond, share):
        b = jnp.asarray(b, x.dtype)
        inside = y if share == 1.0 else jnp.where(y == b, share * y + (1 - share) * b, y)
        return jnp.where(beyond(y, b), b, jnp.where(jnp.isnan(b), lax.stop_gradient(b), inside))

    y = x if min is None else bound(x, min, jnp.less, at_min)
    y = y if max is None else bound(y, max, jnp.greater, at_max)
    return jnp.where(jnp.isnan(x), lax.stop_gradient(x), y)


def _passes_at_bound(op, *args) -> float:
    """The share of the gradient the running torch's `op` gives x where x equals the bound (1.0):
    all of it up to torch 2.13; from 2.14 none for a scalar bound, half for a tensor bound. (Asked
    with gradients on: this module may first be imported inside a user's `torch.no_grad()`.)"""
    with torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        (grad,) = torch.autograd.grad(op(x, *args).sum(), x)
    return float(grad.item())


for _op, _bound in ((aten.clamp.default, 1.0), (aten.clamp.Tensor, torch.ones(1))):
    _at = (_passes_at_bound(_op, _bound, None), _passes_at_bound(_op, None, _bound))
    register(_op)(lambda x, min=None, max=None, at=_at: clamp(x, min, max, *at))
for _op, _bound in ((aten.clamp_min.default, 1.0), (aten.clamp_min.Tensor, torch.ones(1))):
    register(_op)(lambda x, min, at=_passes_at_bound(_op, _bound): clamp(x, min=min, at_min=at))
for _op, _bound in ((aten.clamp_max.default, 1.0), (aten.clamp_max.Tensor, torch.ones(1))):
    register(_op)(lambda x, max, at=_passes_at_bound(_op, _bound): clamp(x, max=max, at_max=at))


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
