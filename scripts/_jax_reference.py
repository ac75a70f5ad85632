"""The benchmark models twice: as torch modules, and written by hand in JAX as a JAX user would.

Used by `scripts/bench_torch.py --vs-jax`: the hand-written JAX step (jax.jit of value_and_grad plus
optax SGD with momentum, parameters and optimizer state donated) is the floor a compiled torch step
is judged against. Each JAX model takes its weights from the torch module (`params_from`), so both
sides compute the same function from the same start; the benchmark checks their first losses agree.

- mlp_small: Linear(32, 16) -> ReLU -> Linear(16, 4), batch 8;
- mlp_wide: Linear(32, 256) -> ReLU -> Linear(256, 4), batch 64;
- transformer: one nn.TransformerEncoderLayer(128, 4 heads, ff 512, post-norm, no dropout) on a
  (16, 32, 128) input, mean over the sequence, Linear(128, 10);
- resnet18: ResNet-18 (7x7 stem, max pool, 4 stages of 2 basic blocks, BatchNorm in training mode
  with running statistics), 4 x 3 x 64 x 64 images, 10 classes. The JAX side is NHWC, the layout
  JAX users write (flax's default); the torch side NCHW, torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax import lax
from torch import nn

LR, MOMENTUM = 0.01, 0.9


@dataclass(frozen=True)
class Model:
    build: Callable[[], nn.Module]                     # the torch module
    batch: Callable[[int, torch.Generator], tuple]    # (inputs, target) of torch tensors
    batch_size: int
    jax_loss: Callable[..., Any]                        # (params, state, x, y) -> (loss, new state)
    params_from: Callable[[nn.Module], tuple[Any, Any]]  # torch module -> (params, state) pytrees
    jax_input: Callable[[torch.Tensor], np.ndarray] = lambda x: x.numpy()


def _t(tensor: torch.Tensor) -> jnp.ndarray:
    return jnp.asarray(tensor.detach().numpy())


def cross_entropy(logits: Any, labels: Any) -> Any:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


# -- MLP ------------------------------------------------------------------------------------------

def _mlp(hidden: int) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _mlp_batch(n: int, g: torch.Generator) -> tuple:
    return (torch.randn(n, 32, generator=g),), torch.randint(0, 4, (n,), generator=g)


def _mlp_params(m: nn.Module) -> tuple[Any, Any]:
    return {"w1": _t(m[0].weight), "b1": _t(m[0].bias), "w2": _t(m[2].weight), "b2": _t(m[2].bias)}, {}


def _mlp_loss(p: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
    h = jax.nn.relu(x @ p["w1"].T + p["b1"])
    return cross_entropy(h @ p["w2"].T + p["b2"], y), state


# -- transformer block ------------------------------------------------------------------------------

D, HEADS, FF, SEQ = 128, 4, 512, 32


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(dim=1))


def _block_batch(n: int, g: torch.Generator) -> tuple:
    return (torch.randn(n, SEQ, D, generator=g),), torch.randint(0, 10, (n,), generator=g)


def _block_params(m: nn.Module) -> tuple[Any, Any]:
    layer = m.layer
    return {"in_w": _t(layer.self_attn.in_proj_weight), "in_b": _t(layer.self_attn.in_proj_bias),
            "out_w": _t(layer.self_attn.out_proj.weight), "out_b": _t(layer.self_attn.out_proj.bias),
            "ln1_w": _t(layer.norm1.weight), "ln1_b": _t(layer.norm1.bias),
            "ff1_w": _t(layer.linear1.weight), "ff1_b": _t(layer.linear1.bias),
            "ff2_w": _t(layer.linear2.weight), "ff2_b": _t(layer.linear2.bias),
            "ln2_w": _t(layer.norm2.weight), "ln2_b": _t(layer.norm2.bias),
            "head_w": _t(m.head.weight), "head_b": _t(m.head.bias)}, {}


def _layer_norm(x: Any, w: Any, b: Any) -> Any:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * w + b


def _block_loss(p: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
    b, s, _ = x.shape
    q, k, v = jnp.split(x @ p["in_w"].T + p["in_b"], 3, axis=-1)
    heads = lambda t: t.reshape(b, s, HEADS, D // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / math.sqrt(D // HEADS)
    attended = (jax.nn.softmax(scores, axis=-1) @ heads(v)).transpose(0, 2, 1, 3).reshape(b, s, D)
    x = _layer_norm(x + attended @ p["out_w"].T + p["out_b"], p["ln1_w"], p["ln1_b"])
    ff = jax.nn.relu(x @ p["ff1_w"].T + p["ff1_b"]) @ p["ff2_w"].T + p["ff2_b"]
    x = _layer_norm(x + ff, p["ln2_w"], p["ln2_b"])
    return cross_entropy(x.mean(axis=1) @ p["head_w"].T + p["head_b"], y), state


# -- ResNet-18 ------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for cout, stride in STAGES:
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _image_batch(n: int, g: torch.Generator) -> tuple:
    return (torch.randn(n, 3, 64, 64, generator=g),), torch.randint(0, 10, (n,), generator=g)


def _conv_w(conv: nn.Conv2d) -> Any:
    return _t(conv.weight).transpose(2, 3, 1, 0)  # OIHW -> HWIO


def _bn(bn: nn.BatchNorm2d) -> tuple[dict, dict]:
    return {"w": _t(bn.weight), "b": _t(bn.bias)}, {"mean": _t(bn.running_mean), "var": _t(bn.running_var)}


def _resnet_params(m: nn.Module) -> tuple[Any, Any]:
    params: dict[str, Any] = {"stem": _conv_w(m.stem[0]), "fc_w": _t(m.fc.weight), "fc_b": _t(m.fc.bias)}
    state: dict[str, Any] = {}
    params["stem_bn"], state["stem_bn"] = _bn(m.stem[1])
    for i, block in enumerate(m.blocks):
        p: dict[str, Any] = {"conv1": _conv_w(block.conv1), "conv2": _conv_w(block.conv2)}
        s: dict[str, Any] = {}
        p["bn1"], s["bn1"] = _bn(block.bn1)
        p["bn2"], s["bn2"] = _bn(block.bn2)
        if block.down is not None:
            p["down"] = _conv_w(block.down[0])
            p["down_bn"], s["down_bn"] = _bn(block.down[1])
        params[f"block{i}"], state[f"block{i}"] = p, s
    return params, state


def _conv(x: Any, w: Any, stride: int, padding: int) -> Any:
    return lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _batch_norm(x: Any, p: Any, s: Any) -> tuple[Any, Any]:
    mean = x.mean(axis=(0, 1, 2))
    var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
    n = x.size // x.shape[-1]
    new = {"mean": 0.9 * s["mean"] + 0.1 * mean, "var": 0.9 * s["var"] + 0.1 * var * n / (n - 1)}
    return (x - mean) * lax.rsqrt(var + 1e-5) * p["w"] + p["b"], new


def _resnet_loss(params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
    new: dict[str, Any] = {}
    h, new["stem_bn"] = _batch_norm(_conv(x, params["stem"], 2, 3), params["stem_bn"], state["stem_bn"])
    h = lax.reduce_window(jax.nn.relu(h), -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                          ((0, 0), (1, 1), (1, 1), (0, 0)))
    i = 0
    for cout, stride in STAGES:
        for first in (True, False):
            p, s, out = params[f"block{i}"], state[f"block{i}"], {}
            step = stride if first else 1
            o, out["bn1"] = _batch_norm(_conv(h, p["conv1"], step, 1), p["bn1"], s["bn1"])
            o, out["bn2"] = _batch_norm(_conv(jax.nn.relu(o), p["conv2"], 1, 1), p["bn2"], s["bn2"])
            skip = h
            if "down" in p:
                skip, out["down_bn"] = _batch_norm(_conv(h, p["down"], step, 0), p["down_bn"], s["down_bn"])
            h = jax.nn.relu(o + skip)
            new[f"block{i}"] = out
            i += 1
    return cross_entropy(h.mean(axis=(1, 2)) @ params["fc_w"].T + params["fc_b"], y), new


MODELS: dict[str, Model] = {
    "mlp_small": Model(_mlp(16), _mlp_batch, 8, _mlp_loss, _mlp_params),
    "mlp_wide": Model(_mlp(256), _mlp_batch, 64, _mlp_loss, _mlp_params),
    "transformer": Model(TransformerBlock, _block_batch, 16, _block_loss, _block_params),
    "resnet18": Model(ResNet18, _image_batch, 4, _resnet_loss, _resnet_params,
                      jax_input=lambda x: x.numpy().transpose(0, 2, 3, 1)),
}


def jax_steps(model: Model) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(train step, forward+backward) of the hand-written model, jitted; the train step donates
    the parameters, model state and optimizer state."""
    opt = optax.sgd(LR, momentum=MOMENTUM)

    def train(params: Any, state: Any, opt_state: Any, x: Any, y: Any) -> Any:
        (loss, state), grads = jax.value_and_grad(model.jax_loss, has_aux=True)(params, state, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    def forward_backward(params: Any, state: Any, x: Any, y: Any) -> Any:
        (loss, state), grads = jax.value_and_grad(model.jax_loss, has_aux=True)(params, state, x, y)
        return loss, grads, state

    return jax.jit(train, donate_argnums=(0, 1, 2)), jax.jit(forward_backward)


def jax_split(model: Model) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(forward, backward) of the hand-written model as two jitted executables, as code whose loss
    is computed between them must run: forward (params, state, x, y) -> (loss, vjp, new state),
    keeping what the backward needs (the VJP's residuals) as outputs; backward (vjp, cotangent)
    -> (gradients,)."""
    def forward(params: Any, state: Any, x: Any, y: Any) -> Any:
        return jax.vjp(lambda p: model.jax_loss(p, state, x, y), params, has_aux=True)

    def backward(vjp: Any, cotangent: Any) -> Any:
        return vjp(cotangent)

    return jax.jit(forward), jax.jit(backward)


def optimizer_init(params: Any) -> Any:
    return optax.sgd(LR, momentum=MOMENTUM).init(params)
