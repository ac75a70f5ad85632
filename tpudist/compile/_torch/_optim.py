"""torch.optim's SGD, Adam and AdamW as JAX update rules, for the fused train step.

The update runs inside the step's XLA executable; the optimizer object stays the source of truth
for its hyperparameters and state. Each step reads every param group's current values (so LR
schedulers and hand edits of `group["lr"]` work without recompiling) into one (params, fields)
float32 table, and the structural choices (momentum on or off, nesterov, amsgrad, maximize,
decoupled weight decay) into a static tuple that is part of the executable's signature. Scalar
work that torch does in Python floats (Adam's bias corrections) is done here on the host the same
way, so the numbers match torch.optim's single-tensor CPU implementations op for op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch._convert import jax_dtype

SUPPORTED = "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW"


@dataclass(frozen=True)
class ParamConfig:
    """The static part of one parameter's update (a key of the compiled step)."""

    kind: str                  # "sgd" | "adam"
    state: tuple[str, ...]     # names of its optimizer.state entries that are tensors
    momentum: bool = False     # sgd: momentum != 0
    nesterov: bool = False
    maximize: bool = False
    amsgrad: bool = False
    decoupled: bool = False    # AdamW's weight decay


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """"sgd" or "adam"; TypeError naming the supported optimizers otherwise."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    raise TypeError(f"the fused train step implements {SUPPORTED} inside the XLA step; got "
                    f"{type(optimizer).__name__}. Use tpudist.fit(..., step_fn=tpudist.eager_step(model, "
                    "loss_fn, optimizer)) or tpudist.optimizer_step for any other torch optimizer.")


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def config(kind: str, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> ParamConfig:
    """The static update structure of a parameter in `group`."""
    if group.get("differentiable"):
        raise ValueError("the fused train step does not support differentiable=True optimizers")
    if kind == "sgd":
        momentum = _float(group["momentum"]) != 0
        return ParamConfig("sgd", ("momentum_buffer",) if momentum else (), momentum=momentum,
                           nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))
    amsgrad = bool(group["amsgrad"])
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    return ParamConfig("adam", ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()),
                       amsgrad=amsgrad, maximize=bool(group["maximize"]), decoupled=decoupled)


FIELDS = 7  # width of the hyperparameter table


def hyper_row(cfg: ParamConfig, group: dict[str, Any], state: dict[str, Any]) -> tuple[list[float], float]:
    """(this step's hyperparameter row, the optimizer step count after it) for one parameter.

    sgd:  lr, momentum, dampening, weight_decay, first (1.0 while there is no momentum buffer yet)
    adam: step_size = lr / (1 - beta1^t), sqrt(1 - beta2^t), eps, beta1, beta2, weight_decay,
          1 - lr * weight_decay (AdamW's decay factor)
    """
    lr, wd = _float(group["lr"]), _float(group["weight_decay"])
    if cfg.kind == "sgd":
        first = 1.0 if state.get("momentum_buffer") is None else 0.0
        return [lr, _float(group["momentum"]), _float(group["dampening"]), wd, first, 0.0, 0.0], 0.0
    beta1, beta2 = (_float(b) for b in group["betas"])
    step = _float(state["step"]) + 1 if "step" in state else 1.0
    step_size = lr / (1 - beta1 ** step)
    bias2_sqrt = math.sqrt(1 - beta2 ** step)
    return [step_size, bias2_sqrt, _float(group["eps"]), beta1, beta2, wd, 1 - lr * wd], step


def initial_state(cfg: ParamConfig, param: torch.Tensor) -> list[np.ndarray]:
    """Zeros for every state tensor the optimizer has not created yet (SGD's first step ignores
    its buffer: `first` is 1.0 then)."""
    return [np.zeros(tuple(param.shape), dtype=jax_dtype(param.dtype)) for _ in cfg.state]


def update(cfg: ParamConfig, param: Any, grad: Any, state: tuple[Any, ...], row: Any) -> tuple[Any, tuple[Any, ...]]:
    """One parameter's update in JAX, as torch.optim computes it: (new param, new state)."""
    row = row.astype(param.dtype)
    if cfg.maximize:
        grad = -grad
    if cfg.kind == "sgd":
        lr, momentum, dampening, wd, first = (row[i] for i in range(5))
        grad = grad + wd * param
        new_state: tuple[Any, ...] = ()
        if cfg.momentum:
            (buf,) = state
            buf = jnp.where(first > 0.5, grad, buf * momentum + (1 - dampening) * grad)
            grad = grad + momentum * buf if cfg.nesterov else buf
            new_state = (buf,)
        return param - lr * grad, new_state
    step_size, bias2_sqrt, eps, beta1, beta2, wd, decay = (row[i] for i in range(FIELDS))
    if cfg.decoupled:
        param = param * decay
    else:
        grad = grad + wd * param
    exp_avg, exp_avg_sq, *rest = state
    exp_avg = exp_avg + (1 - beta1) * (grad - exp_avg)          # torch: exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    second = exp_avg_sq
    new_state = (exp_avg, exp_avg_sq)
    if cfg.amsgrad:
        second = jnp.maximum(rest[0], exp_avg_sq)
        new_state += (second,)
    denom = jnp.sqrt(second) / bias2_sqrt + eps
    return param - step_size * (exp_avg / denom), new_state
