"""CTC loss (`F.ctc_loss`, Wav2Vec2ForCTC's objective): the forward recursion over time as one scan.

torch's `_ctc_loss` has a data-dependent output (its alignment table is as long as the longest
target), so capture traces `torch.ctc_loss` as `tpudist::ctc_loss` (the per-example losses only,
`CtcAsOneOp`). The gradient is torch's: JAX's of the log-space recursion plus `exp(log_probs)` times
the loss's cotangent (torch's backward is the derivative with respect to the logits under a
log_softmax, so it equals the true one only after log_softmax's backward; a model that feeds
log_probs from elsewhere trains on torch's formula in eager mode, and so here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import torch

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import custom_vjp

_FLOOR = -1e30  # log(0) stand-in: -inf would make the logaddexp gradients NaN


# a plain library op, not torch.library.custom_op: that one differentiates through an autograd.Function,
# which capture intercepts (see _custom_grad); the gradient here is JAX's
_LIB = torch.library.Library("tpudist", "FRAGMENT")
_LIB.define("ctc_loss(Tensor log_probs, Tensor targets, Tensor input_lengths, Tensor target_lengths, int blank, "
            "bool zero_infinity) -> Tensor")


def _ctc_loss_eager(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """Each example's CTC loss (`aten._ctc_loss`'s first output) as one graph node of static shape."""
    return torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank,
                                           zero_infinity)[0].clone()


_LIB.impl("ctc_loss", _ctc_loss_eager, "CompositeExplicitAutograd")


@torch.library.register_fake("tpudist::ctc_loss", lib=_LIB)
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty((log_probs.shape[1],))


CTC_LOSS = torch.ops.tpudist.ctc_loss.default
_MEAN, _SUM = 1, 2  # torch's reduction enum (torch.nn._reduction)


class CtcAsOneOp(torch.overrides.TorchFunctionMode):
    """While capturing: `F.ctc_loss` / `torch.ctc_loss` as `tpudist::ctc_loss` and torch's reduction
    of it, so no graph node has a data-dependent shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) != "ctc_loss" or func is CTC_LOSS:
            return func(*args, **kwargs)
        names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")
        values = dict(zip(names, (None, None, None, None, 0, _MEAN, False)))
        values.update(zip(names, args))
        values.update(kwargs)
        reduction = values["reduction"]  # F.ctc_loss's name, or torch.ctc_loss's enum
        reduction = {"none": 0, "mean": _MEAN, "sum": _SUM}[reduction] if isinstance(reduction, str) else reduction
        log_probs = values["log_probs"]
        lengths = [torch.as_tensor(values[k], device=log_probs.device) for k in ("input_lengths", "target_lengths")]
        loss = CTC_LOSS(log_probs, values["targets"], *lengths, int(values["blank"]), bool(values["zero_infinity"]))
        if reduction == _MEAN:
            return (loss / lengths[1].clamp_min(1).to(loss.dtype)).mean()
        return loss.sum() if reduction == _SUM else loss


@register(CTC_LOSS)
def ctc(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return _ctc(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)


@functools.partial(custom_vjp, nondiff_argnums=(4, 5))
def _ctc(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return _losses(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]


def _ctc_fwd(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    loss, vjp, impossible = jax.vjp(
        lambda lp: _losses(lp, targets, input_lengths, target_lengths, blank, zero_infinity), log_probs,
        has_aux=True)
    return loss, (vjp, log_probs, input_lengths, impossible)


def _ctc_bwd(blank, zero_infinity, saved, g):
    """torch's ctc_loss_backward (aten/src/ATen/native/LossCTC.cpp): per step t < input_length,
    (exp(lp) - exp(log(alpha beta) + nll - lp)) * g, the second term being JAX's gradient; 0 for
    later steps, and for an impossible alignment 0 with zero_infinity, else NaN (torch's inf - inf)."""
    vjp, log_probs, input_lengths, impossible = saved
    (grad,) = vjp(g)
    live = jnp.arange(log_probs.shape[0])[:, None] < input_lengths.astype(jnp.int32)[None, :]  # (T, N)
    grad = jnp.where(live[..., None], grad + jnp.exp(log_probs) * g[None, :, None].astype(log_probs.dtype), 0)
    lost = impossible[None, :, None] if zero_infinity else impossible[None, :, None] & live[..., None]
    grad = jnp.where(lost, 0.0 if zero_infinity else jnp.nan, grad).astype(log_probs.dtype)
    return grad, None, None, None


_ctc.defvjp(_ctc_fwd, _ctc_bwd)


def _losses(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """(each example's loss, whether its target cannot be aligned in its input length)."""
    steps, batch, _ = log_probs.shape
    target_lengths = target_lengths.astype(jnp.int32)
    if targets.ndim == 1:  # concatenated targets: cut each example's out (padded to the total length)
        width = targets.shape[0]
        start = jnp.cumsum(target_lengths) - target_lengths
        position = start[:, None] + jnp.arange(width)[None, :]
        padded = targets[jnp.clip(position, 0, max(width - 1, 0))]
    else:
        width, padded = targets.shape[1], targets
    padded = jnp.where(jnp.arange(width)[None, :] < target_lengths[:, None], padded, blank).astype(jnp.int32)
    states = 2 * width + 1
    labels = jnp.full((batch, states), blank, jnp.int32).at[:, 1::2].set(padded)  # blank, l1, blank, l2, ...
    skip = (labels != blank) & (labels != jnp.pad(labels, ((0, 0), (2, 0)), constant_values=blank)[:, :-2])
    skip = skip.at[:, :2].set(False)
    dtype = jnp.promote_types(log_probs.dtype, jnp.float32)
    lp = jnp.take_along_axis(log_probs.astype(dtype), jnp.broadcast_to(labels[None], (steps, batch, states)),
                             axis=2)  # (T, N, S): each state's label's log-probability per step
    start = jnp.full((batch, states), _FLOOR, dtype).at[:, :2].set(lp[0, :, :2])

    def step(alpha, inputs):
        emit, t = inputs
        one = jnp.pad(alpha, ((0, 0), (1, 0)), constant_values=_FLOOR)[:, :-1]
        two = jnp.where(skip, jnp.pad(alpha, ((0, 0), (2, 0)), constant_values=_FLOOR)[:, :-2], _FLOOR)
        new = jnp.logaddexp(jnp.logaddexp(alpha, one), two) + emit
        new = jnp.maximum(new, _FLOOR)
        return jnp.where((t < input_lengths.astype(jnp.int32))[:, None], new, alpha), None

    last, _ = jax.lax.scan(step, start, (lp[1:], jnp.arange(1, steps)))
    end = 2 * target_lengths
    final = jnp.take_along_axis(last, end[:, None], axis=1)[:, 0]
    before = jnp.where(end > 0, jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0], _FLOOR)
    likelihood = jnp.logaddexp(final, before)
    impossible = likelihood < _FLOOR / 2
    return jnp.where(impossible, 0.0 if zero_infinity else jnp.inf, -likelihood).astype(log_probs.dtype), impossible
