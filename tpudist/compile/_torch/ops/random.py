"""Random ops. Each receives a JAX PRNG key (folded from the per-call seed and the node's position),
so a compiled call is reproducible under `torch.manual_seed` but does not replay torch's own stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpudist.compile._torch._registry import register

aten = __import__("torch").ops.aten


@register(aten.native_dropout.default, random=True)
def native_dropout(key, x, p, train):
    """Returns (output, keep_mask); kept elements are scaled by 1 / (1 - p), as in torch."""
    if train is False or p == 0:
        return x, jnp.ones(x.shape, bool)
    if p >= 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, bool)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / (1.0 - p), 0).astype(x.dtype), keep


@register(aten.rand.default, random=True)
def rand(key, size, *, dtype=None, generator=None):
    return jax.random.uniform(key, tuple(size), dtype or jnp.float32)


@register(aten.randn.default, random=True)
def randn(key, size, *, dtype=None, generator=None):
    return jax.random.normal(key, tuple(size), dtype or jnp.float32)


@register(aten.rand_like.default, random=True)
def rand_like(key, x, *, dtype=None):
    return jax.random.uniform(key, x.shape, dtype or x.dtype)


@register(aten.randn_like.default, random=True)
def randn_like(key, x, *, dtype=None):
    return jax.random.normal(key, x.shape, dtype or x.dtype)


@register(aten.bernoulli.default, random=True)
def bernoulli(key, probabilities, *, generator=None):
    return (jax.random.uniform(key, probabilities.shape) < probabilities).astype(probabilities.dtype)


@register(aten.bernoulli.p, random=True)
def bernoulli_p(key, x, p=0.5, *, generator=None):
    return (jax.random.uniform(key, x.shape) < p).astype(x.dtype)


@register(aten.randint.low, random=True)
def randint_low(key, low, high, size, *, dtype=None, generator=None):
    return jax.random.randint(key, tuple(size), low, high)


@register(aten.randint.default, random=True)
def randint(key, high, size, *, dtype=None, generator=None):
    return jax.random.randint(key, tuple(size), 0, high)
