"""Normalization: LayerNorm, BatchNorm (training and eval), GroupNorm, InstanceNorm; half-precision
inputs are normalized in float32, as torch's kernels do.

The saved statistics layer and batch norm also return (mean, rstd) carry no gradient: torch's
derivatives of native_layer_norm / native_batch_norm read only the output's gradient and drop
whatever reaches the saved mean and rstd, so they are returned through `stop_gradient` here
(native_group_norm's derivative does use them, so its statistics stay differentiable)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import in_float32
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _moments(x, axes):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    return mean, jnp.mean(centered * centered, axis=axes, keepdims=True)


@register(aten.native_layer_norm.default)
@in_float32
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    """Returns (output, mean, rstd); mean and rstd keep the normalized dims as size 1."""
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean, var = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, lax.stop_gradient(mean), lax.stop_gradient(rstd)


def _channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _affine(out, weight, bias):
    if weight is not None:
        out = out * _channel(weight, out.ndim)
    if bias is not None:
        out = out + _channel(bias, out.ndim)
    return out


def _batch_stats(x, weight, bias, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    saved_mean, saved_rstd = lax.stop_gradient(mean.reshape(-1)), lax.stop_gradient(rstd.reshape(-1))
    return _affine((x - mean) * rstd, weight, bias), saved_mean, var.reshape(-1), saved_rstd


@register(aten._native_batch_norm_legit_functional.default)
@in_float32
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Returns (output, save_mean, save_rstd, new_running_mean, new_running_var)."""
    if not training:
        out, mean, rstd = batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps)
        return out, mean, rstd, running_mean, running_var
    out, mean, var, rstd = _batch_stats(x, weight, bias, eps)
    n = x.size // x.shape[1]
    # running statistics follow torch: an exponential average, of the unbiased batch variance
    unbiased = lax.stop_gradient(var) * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * lax.stop_gradient(mean)
    new_var = (1 - momentum) * running_var + momentum * unbiased
    return out, mean, rstd, new_mean, new_var


@register(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(x, weight, bias, running_mean, running_var, momentum, eps):
    """Returns (output, save_mean, save_rstd, reserve, new_running_mean, new_running_var); the
    reserve is cuDNN's workspace, empty elsewhere."""
    out, mean, rstd, new_mean, new_var = batch_norm_functional(x, weight, bias, running_mean, running_var,
                                                               True, momentum, eps)
    return out, mean, rstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var


@register(aten._native_batch_norm_legit_no_training.default)
@in_float32
def batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    """Returns (output, empty, empty): eval mode normalizes with the running statistics."""
    out = (x - _channel(running_mean, x.ndim)) * _channel(lax.rsqrt(running_var + eps), x.ndim)
    empty = jnp.zeros((0,), x.dtype)
    return _affine(out, weight, bias), empty, empty


@register(aten._native_batch_norm_legit.no_stats)
@in_float32
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, _, rstd = _batch_stats(x, weight, bias, eps)
    return out, mean, rstd


@register(aten.native_group_norm.default)
@in_float32
def native_group_norm(x, weight, bias, n, c, hw, group, eps):
    """Returns (output, mean, rstd) with mean and rstd of shape (N, group)."""
    grouped = x.reshape((n, group, -1))
    mean, var = _moments(grouped, (2,))
    rstd = lax.rsqrt(var + eps)
    out = ((grouped - mean) * rstd).reshape(x.shape)
    return _affine(out, weight, bias), mean.reshape(n, group), rstd.reshape(n, group)
