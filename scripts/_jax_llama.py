"""A Llama decoder written by hand in JAX, as a JAX user would, for scripts/bench_sharded.py.

Same architecture and shapes as `transformers.LlamaForCausalLM` (no biases, untied lm head):
embedding, per layer RMSNorm -> rotary attention with grouped-query heads -> residual, RMSNorm ->
SwiGLU MLP -> residual; final RMSNorm, lm head, next-token cross entropy (HF's shifted labels).
The parameters are a flat dict keyed by the torch model's parameter names, weights stored
(out, in) as nn.Linear stores them, so that a `PartitionSpec` tpudist chose for a torch
parameter lays out the JAX parameter of the same name unchanged.

Two program shapes: `loss` runs the layers as a Python loop (each layer lowered on its own);
`loss_scanned` runs them under one `jax.lax.scan` (no remat) over the layers' parameters stacked
along a new leading dim (`stack`: "model.layers.*.<name>", shape (layers, ...), laid out as
layer 0's parameter with a leading None), as a JAX user writes a deep model to compile it once.

    params = params_from(torch_model)
    step, params, opt_state = train_step(spec, params, param_shardings, batch_sharding, lr=1e-3,
                                         weight_decay=0.01, scan=False)
    params, opt_state, loss = step(params, opt_state, ids)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

STACKED = "model.layers.*."  # the stacked parameters' prefix: model.layers.*.mlp.up_proj.weight, (layers, f, h)


@dataclass(frozen=True)
class Spec:
    """The model's sizes, read from a `transformers.LlamaConfig` (`of`)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float

    @classmethod
    def of(cls, config: Any) -> Spec:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads, head_dim, config.rms_norm_eps,
                   float(theta))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape, by the torch model's parameter name."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                        p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f),
                        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update({"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)})
        return out


def params_from(model: Any) -> dict[str, jax.Array]:
    """The torch model's weights as the JAX parameters (host arrays, same names)."""
    return {name: np.asarray(p.detach().numpy()) for name, p in model.named_parameters()}


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    """The parameter count of `Spec.shapes()`."""
    return sum(int(np.prod(shape)) for shape in shapes.values())


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return w * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _rotary(spec: Spec, seq: int) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / spec.rope_theta ** (jnp.arange(0, spec.head_dim, 2, dtype=jnp.float32) / spec.head_dim)
    freqs = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # (seq, head_dim)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (batch, heads, seq, head_dim) rotated: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attention(spec: Spec, p: dict[str, jax.Array], prefix: str, x: jax.Array, cos: jax.Array,
               sin: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    d = spec.head_dim

    def heads(w: jax.Array, n: int) -> jax.Array:
        return (x @ w.T).reshape(b, s, n, d).transpose(0, 2, 1, 3)
    q = _rotate(heads(p[prefix + "q_proj.weight"], spec.heads), cos, sin)
    k = _rotate(heads(p[prefix + "k_proj.weight"], spec.kv_heads), cos, sin)
    v = heads(p[prefix + "v_proj.weight"], spec.kv_heads)
    group = spec.heads // spec.kv_heads  # grouped-query: each key/value head serves `group` query heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (d ** -0.5)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, spec.heads * d)
    return out @ p[prefix + "o_proj.weight"].T


def _mlp(p: dict[str, jax.Array], prefix: str, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ p[prefix + "gate_proj.weight"].T)
    return (gate * (x @ p[prefix + "up_proj.weight"].T)) @ p[prefix + "down_proj.weight"].T


def _layer(spec: Spec, p: dict[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """One decoder layer; `p` keyed by the names under the layer ("mlp.up_proj.weight")."""
    x = x + _attention(spec, p, "self_attn.", _rms_norm(x, p["input_layernorm.weight"], spec.eps), cos, sin)
    return x + _mlp(p, "mlp.", _rms_norm(x, p["post_attention_layernorm.weight"], spec.eps))


def _under(params: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}


def _head_loss(spec: Spec, params: dict[str, jax.Array], x: jax.Array, ids: jax.Array) -> jax.Array:
    x = _rms_norm(x, params["model.norm.weight"], spec.eps)
    logits = (x @ params["lm_head.weight"].T).astype(jnp.float32)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def loss(spec: Spec, params: dict[str, jax.Array], ids: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of `ids` (batch, seq): logits at t predict ids at t + 1."""
    cos, sin = _rotary(spec, ids.shape[1])
    x = params["model.embed_tokens.weight"][ids]
    for i in range(spec.layers):
        x = _layer(spec, _under(params, f"model.layers.{i}."), x, cos, sin)
    return _head_loss(spec, params, x, ids)


def loss_scanned(spec: Spec, params: dict[str, jax.Array], ids: jax.Array) -> jax.Array:
    """`loss` of the stacked parameters (`stack`), the layers under one `lax.scan`."""
    cos, sin = _rotary(spec, ids.shape[1])
    x = params["model.embed_tokens.weight"][ids]
    x, _ = jax.lax.scan(lambda h, p: (_layer(spec, p, h, cos, sin), None), x, _under(params, STACKED))
    return _head_loss(spec, params, x, ids)


def _layer_name(name: str) -> tuple[int, str] | None:
    """(layer, name under it) of "model.layers.<i>.<name>", else None."""
    if not name.startswith("model.layers."):
        return None
    index, rest = name.removeprefix("model.layers.").split(".", 1)
    return int(index), rest


def stack(params: dict[str, Any]) -> dict[str, Any]:
    """Each layer parameter stacked over the layers as STACKED + its name, the others unchanged."""
    out, layers = {}, {}
    for name, value in params.items():
        at = _layer_name(name)
        if at is None:
            out[name] = value
        else:
            layers.setdefault(at[1], {})[at[0]] = value
    for rest, by_layer in layers.items():
        out[STACKED + rest] = np.stack([by_layer[i] for i in sorted(by_layer)])
    return out


def stack_shardings(shardings: dict[str, NamedSharding]) -> dict[str, NamedSharding]:
    """`stack`'s shardings: a stacked parameter laid out as every layer's own, after a leading None."""
    out, layers = {}, {}
    for name, sharding in shardings.items():
        at = _layer_name(name)
        if at is None:
            out[name] = sharding
        else:
            layers.setdefault(at[1], {})[at[0]] = sharding.spec
    for rest, by_layer in layers.items():
        specs = set(by_layer.values())
        if len(specs) != 1:
            raise ValueError(f"model.layers.<i>.{rest} is laid out differently per layer ({sorted(map(str, specs))});"
                             " a stacked parameter takes one layout")
        mesh = shardings[f"model.layers.{min(by_layer)}.{rest}"].mesh
        out[STACKED + rest] = NamedSharding(mesh, PartitionSpec(None, *specs.pop()))
    return out


def optimizer(lr: float, weight_decay: float) -> optax.GradientTransformation:
    """AdamW as torch.optim.AdamW's defaults have it (betas 0.9/0.999, eps 1e-8, decay on every parameter)."""
    return optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def train_step(spec: Spec, params: dict[str, Any], param_shardings: dict[str, Any], batch_sharding: Any, *,
               lr: float, weight_decay: float, scan: bool = False) -> tuple[Callable[..., Any], Any, Any]:
    """(step, params, opt_state): the jitted step (params, opt_state, ids) -> (params, opt_state,
    loss), parameters and optimizer state donated and laid out by `param_shardings` in and out (the
    moments as their parameter, the step count replicated), and the initial state so placed.
    `scan=True`: `loss_scanned` on the parameters and shardings stacked (`stack`)."""
    if scan:
        params, param_shardings = stack(params), stack_shardings(param_shardings)
    model_loss = loss_scanned if scan else loss
    opt = optimizer(lr, weight_decay)
    params = {name: jax.device_put(value, param_shardings[name]) for name, value in params.items()}
    state_shardings = _state_shardings(opt, params, param_shardings)
    opt_state = jax.jit(opt.init, out_shardings=state_shardings)(params)

    def step(params: Any, opt_state: Any, ids: jax.Array) -> Any:
        value, grads = jax.value_and_grad(lambda p: model_loss(spec, p, ids))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    jitted = jax.jit(step, in_shardings=(param_shardings, state_shardings, batch_sharding),
                     out_shardings=(param_shardings, state_shardings, replicated), donate_argnums=(0, 1))
    return jitted, params, opt_state


def _state_shardings(opt: optax.GradientTransformation, params: dict[str, Any], param_shardings: dict[str, Any]) -> Any:
    """The optimizer state's shardings: a leaf shaped like a parameter dict takes its parameter's."""
    mesh = next(iter(param_shardings.values())).mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = jax.eval_shape(opt.init, params)

    def lay(node: Any) -> Any:
        if isinstance(node, dict) and set(node) == set(param_shardings):
            return dict(param_shardings)
        if isinstance(node, dict):
            return {k: lay(v) for k, v in node.items()}
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(lay(v) for v in node))
        if isinstance(node, (tuple, list)):
            return type(node)(lay(v) for v in node)
        return replicated
    return lay(shapes)
