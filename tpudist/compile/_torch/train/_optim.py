"""torch.optim's SGD, Adam and AdamW as JAX update rules, for the fused train step.

The update runs inside the step's XLA executable; the optimizer object stays the source of truth
for its hyperparameters. Each step reads every param group's current values (so LR schedulers and
hand edits of `group["lr"]` work without recompiling) into one (groups, fields) float32 table,
sent to the devices only when it changes, and the structural choices (momentum on or off,
nesterov, amsgrad, maximize, decoupled weight decay) into a static tuple that is part of the
executable's signature. Each parameter's step count (Adam's `state["step"]`; for SGD, whether
its momentum buffer exists yet) lives on the devices beside the optimizer state, so Adam's bias
corrections are computed in-graph: `1 - beta^t` as `-expm1(t * log(beta))` from `log(beta)`
computed on the host in double precision, which keeps them within float32 rounding of torch's
Python-float values. Otherwise the numbers follow torch.optim's single-tensor CPU code op for op.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch._convert import jax_dtype

SUPPORTED = "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW"


class OptimizerKind(enum.StrEnum):
    """Which update rule a parameter takes (AdamW is Adam with decoupled weight decay)."""

    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True)
class ParamConfig:
    """The static part of one parameter's update (a key of the compiled step)."""

    kind: OptimizerKind
    state: tuple[str, ...]     # names of its optimizer.state entries that are tensors
    momentum: bool = False     # sgd: momentum != 0
    nesterov: bool = False
    maximize: bool = False
    amsgrad: bool = False
    decoupled: bool = False    # AdamW's weight decay


def kind_of(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    """The optimizer's update rule; TypeError naming the supported optimizers otherwise."""
    if isinstance(optimizer, torch.optim.SGD):
        return OptimizerKind.SGD
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return OptimizerKind.ADAM
    raise TypeError(f"the fused train step implements {SUPPORTED} inside the XLA step; got "
                    f"{type(optimizer).__name__}. Use tpudist.fit(..., step_fn=tpudist.eager_step(model, "
                    "loss_fn, optimizer)) or tpudist.optimizer_step for any other torch optimizer.")


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def config(kind: OptimizerKind, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> ParamConfig:
    """The static update structure of a parameter in `group`."""
    if group.get("differentiable"):
        raise ValueError("the fused train step does not support differentiable=True optimizers")
    if kind == OptimizerKind.SGD:
        momentum = _float(group["momentum"]) != 0
        return ParamConfig(OptimizerKind.SGD, ("momentum_buffer",) if momentum else (), momentum=momentum,
                           nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))
    amsgrad = bool(group["amsgrad"])
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    return ParamConfig(OptimizerKind.ADAM, ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()),
                       amsgrad=amsgrad, maximize=bool(group["maximize"]), decoupled=decoupled)


FIELDS = 9  # width of the hyperparameter table


def hyper_row(kind: OptimizerKind, group: dict[str, Any]) -> list[float]:
    """One param group's row of the hyperparameter table (read on the host every step).

    sgd:  lr, momentum, dampening, weight_decay
    adam: lr, log(beta1), log(beta2), 1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay

    Differences such as 1 - beta2 are taken here, in doubles, as torch takes them: in float32 on the
    device, 1 - 0.999 is 1.3e-5 off, and so is every second moment's new term.
    """
    lr, wd = _float(group["lr"]), _float(group["weight_decay"])
    if kind == OptimizerKind.SGD:
        return [lr, _float(group["momentum"]), _float(group["dampening"]), wd] + [0.0] * (FIELDS - 4)
    beta1, beta2 = (_float(b) for b in group["betas"])
    return [lr, math.log(beta1) if beta1 > 0 else -math.inf, math.log(beta2) if beta2 > 0 else -math.inf,
            1 - beta1, beta2, 1 - beta2, _float(group["eps"]), wd, 1 - lr * wd]


def initial_state(cfg: ParamConfig, param: torch.Tensor) -> list[np.ndarray]:
    """Zeros for every state tensor the optimizer has not created yet (SGD's first step ignores
    its buffer: its step count is 0 then)."""
    return [np.zeros(tuple(param.shape), dtype=jax_dtype(param.dtype)) for _ in cfg.state]


def step_count(cfg: ParamConfig, state: dict[str, Any]) -> float:
    """How many updates torch's optimizer state says this parameter has had: Adam's `step`; for
    SGD with momentum, 1 once its momentum buffer exists (all the update rule needs to know)."""
    if cfg.kind == OptimizerKind.ADAM:
        return _float(state["step"]) if "step" in state else 0.0
    return 1.0 if state.get("momentum_buffer") is not None else 0.0


def coefficients(kind: OptimizerKind, hyper: jax.Array, groups: list[int], counts: jax.Array) -> jax.Array:
    """The per-parameter scalars of the update for parameters of `groups` with step counts
    `counts` (before this update), computed together as vectors: XLA otherwise compiles and runs a
    kernel or two of scalar arithmetic per parameter (BART 2+2 under AdamW: 182 of its 612).
    Rows: sgd: whether the parameter has stepped before; adam: step size, 1 / sqrt(bias correction 2)."""
    rows = hyper.astype(jnp.float32)[np.asarray(groups, np.int32)]
    counts = counts.astype(jnp.float32)
    if kind == OptimizerKind.SGD:
        return (counts != 0).astype(jnp.float32)[None]
    t = counts + 1
    step_size = rows[:, 0] / -jnp.expm1(t * rows[:, 1])
    # as a reciprocal: XLA rewrites x / scalar as x * (1 / scalar) anyway, one more kernel per parameter
    return jnp.stack([step_size, 1 / jnp.sqrt(-jnp.expm1(t * rows[:, 2]))])


def update(cfg: ParamConfig, param: jax.Array, grad: jax.Array, state: tuple[jax.Array, ...], row: jax.Array,
           scalars: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One parameter's update in JAX, as torch.optim computes it: (new param, new state).
    `scalars`: this parameter's column of `coefficients`."""
    row = row.astype(jnp.float32)
    if cfg.maximize:
        grad = -grad
    if cfg.kind == OptimizerKind.SGD:
        lr, momentum, dampening, wd = (row[i].astype(param.dtype) for i in range(4))
        grad = grad + wd * param
        new_state: tuple[jax.Array, ...] = ()
        if cfg.momentum:
            (buf,) = state
            buf = jnp.where(scalars[0] == 0, grad, buf * momentum + (1 - dampening) * grad)
            grad = grad + momentum * buf if cfg.nesterov else buf
            new_state = (buf,)
        return param - lr * grad, new_state
    step_size, inv_bias2_sqrt = (scalars[i].astype(param.dtype) for i in range(2))
    one_minus_beta1, beta2, one_minus_beta2, eps, wd, decay = (row[i].astype(param.dtype) for i in range(3, FIELDS))
    if cfg.decoupled:
        param = param * decay
    else:
        grad = grad + wd * param
    exp_avg, exp_avg_sq, *rest = state
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)      # torch: exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    second = exp_avg_sq
    new_state = (exp_avg, exp_avg_sq)
    if cfg.amsgrad:
        second = jnp.maximum(rest[0], exp_avg_sq)
        new_state += (second,)
    denom = jnp.sqrt(second) * inv_bias2_sqrt + eps
    return param - step_size * (exp_avg / denom), new_state


def update_all(configs: list[ParamConfig], groups: list[int], params: list[jax.Array], grads: list[jax.Array],
               states: list[tuple[jax.Array, ...]], hyper: jax.Array, counts: jax.Array,
               together_bytes: int = 0,
               layers: list[int] | None = None) -> tuple[list[jax.Array], list[tuple[jax.Array, ...]]]:
    """`update` for every parameter (`counts`: their step counts, a vector): (new params, new
    states) in the order given, their scalars computed together (`coefficients`). `layers[j]`, where
    not 0: `params[j]` (with its gradient and state) is that many layers' copies of one parameter
    stacked on a first dim, each copy with its own step count in `counts` (in order), so each row
    takes the update its own parameter would.

    Parameters of up to `together_bytes` (per layer) that share a configuration, group and dtype are
    updated as one concatenated array (torch's foreach), each element with its parameter's scalars,
    so the numbers are `update`'s. Only where their pieces are concatenated again in the same order
    (the one-device pool, `_pool.flatten_state`), so XLA sees whole runs and cuts nothing."""
    if not configs:
        return [], []
    layers = list(layers or [0] * len(params))
    rows = [max(1, n) for n in layers]  # columns of `scalars` per parameter
    first = np.cumsum([0] + rows)
    scalars = coefficients(configs[0].kind, hyper, [g for g, n in zip(groups, rows) for _ in range(n)], counts)

    def column(j: int) -> jax.Array:
        """Parameter j's scalars: a column, or one per layer shaped to broadcast over its stack."""
        if not layers[j]:
            return scalars[:, first[j]]
        return scalars[:, first[j]:first[j + 1]].reshape((scalars.shape[0], layers[j]) + (1,) * (params[j].ndim - 1))

    sets: dict[Any, list[int]] = {}
    for j, (cfg, group, p, s) in enumerate(zip(configs, groups, params, states)):
        small = p.size // rows[j] * p.dtype.itemsize <= together_bytes
        sets.setdefault((cfg, group, p.dtype, tuple(a.dtype for a in s)) if small else j, []).append(j)
    new_params: list[Any] = [None] * len(params)
    new_states: list[Any] = [None] * len(params)
    for members in sets.values():
        j = members[0]
        if len(members) == 1:
            new_params[j], new_states[j] = update(configs[j], params[j], grads[j], tuple(states[j]),
                                                  hyper[groups[j]], column(j))
            continue
        sizes = [params[i].size for i in members]
        columns = np.concatenate([np.arange(first[i], first[i + 1]) for i in members])
        per_column = np.concatenate([[params[i].size // rows[i]] * rows[i] for i in members])
        flat = lambda arrays: jnp.concatenate([a.reshape(-1) for a in arrays])  # noqa: E731
        each = jnp.repeat(scalars[:, columns], per_column, axis=1, total_repeat_length=sum(sizes))
        param, state = update(configs[j], flat([params[i] for i in members]), flat([grads[i] for i in members]),
                              tuple(flat([states[i][k] for i in members]) for k in range(len(states[j]))),
                              hyper[groups[j]], each)
        cuts = np.cumsum([0] + sizes)
        for n, i in enumerate(members):
            piece = lambda a: a[cuts[n]:cuts[n + 1]].reshape(params[i].shape)  # noqa: E731
            new_params[i], new_states[i] = piece(param), tuple(piece(a) for a in state)
    return new_params, new_states
