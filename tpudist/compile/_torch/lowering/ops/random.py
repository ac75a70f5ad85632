"""Random ops. Each receives a JAX PRNG key (folded from the per-call seed and the node's position),
so a compiled call is reproducible under `torch.manual_seed` but does not replay torch's own stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpudist._jaxcompat import varying_axes
from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


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


@register(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(key, x, p, *, generator=None):
    """`x.bernoulli_(p)` with a tensor of probabilities (broadcast to x's shape)."""
    return (jax.random.uniform(key, x.shape) < jnp.broadcast_to(p, x.shape)).astype(x.dtype)


@register(aten.randint_like.default, random=True)
def randint_like(key, x, high, *, dtype=None):
    return jax.random.randint(key, x.shape, 0, high)


@register(aten.randint_like.low_dtype, random=True)
def randint_like_low(key, x, low, high, *, dtype=None):
    return jax.random.randint(key, x.shape, low, high)


@register(aten.uniform.default, random=True)
def uniform(key, x, low=0.0, high=1.0, *, generator=None):
    """`x.uniform_(low, high)`: U[low, high) in x's shape and dtype."""
    return jax.random.uniform(key, x.shape, _floating(x), low, high)


@register(aten.normal_functional.default, random=True)
def normal_like(key, x, mean=0.0, std=1.0, *, generator=None):
    """`x.normal_(mean, std)`."""
    return mean + std * jax.random.normal(key, x.shape, _floating(x))


@register(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor, random=True)
def normal(key, mean, std=1.0, *, generator=None):
    """`torch.normal(mean, std)` with either a tensor: one draw per element of the broadcast shape; the
    gradient reaches mean (1) and std (the standard draw), as torch's does."""
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = next((v.dtype for v in (mean, std) if hasattr(v, "dtype")), jnp.float32)
    return mean + std * jax.random.normal(key, shape, dtype)


@register(aten.normal.float_float, random=True)
def normal_sized(key, mean, std, size, *, generator=None, dtype=None):
    return mean + std * jax.random.normal(key, tuple(size), dtype or jnp.float32)


@register(aten.exponential.default, random=True)
def exponential(key, x, rate=1.0, *, generator=None):
    return jax.random.exponential(key, x.shape, _floating(x)) / rate


@register(aten.cauchy.default, random=True)
def cauchy(key, x, median=0.0, sigma=1.0, *, generator=None):
    return median + sigma * jax.random.cauchy(key, x.shape, _floating(x))


@register(aten.log_normal.default, random=True)
def log_normal(key, x, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(mean + std * jax.random.normal(key, x.shape, jnp.float32))


@register(aten.geometric.default, random=True)
def geometric(key, x, p, *, generator=None):
    """The number of Bernoulli(p) trials up to the first success (1, 2, ...), as torch draws it:
    ceil(log(u) / log(1 - p)) for u uniform in (0, 1]."""
    u = 1.0 - jax.random.uniform(key, x.shape, jnp.float32)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p))


@register(aten.random.default, random=True)
def random_full(key, x, *, generator=None):
    """`x.random_()`: integers uniform over [0, 2**digits] for floating x (digits: the mantissa's, so
    every value is exact), [0, max] for integer x."""
    return _integers(key, x, 0, _random_top(x.dtype))


@register(aten.random.to, random=True)
def random_to(key, x, to, *, generator=None):
    return _integers(key, x, 0, to)


@register(getattr(aten.random, "from"), random=True)
def random_from(key, x, low, to=None, *, generator=None):
    return _integers(key, x, low, _random_top(x.dtype) if to is None else to)


@register(aten.randperm.default, random=True)
def randperm(key, n, *, dtype=None, generator=None):
    return jax.random.permutation(key, n)


@register(aten.multinomial.default, random=True)
def multinomial(key, probabilities, samples, replacement=False, *, generator=None):
    """Category indices drawn with the (unnormalized, non-negative) weights of the last dimension.
    Without replacement: the Gumbel top-k draw, which picks `samples` distinct categories with
    torch's sequential-draw distribution; categories of weight 0 are never drawn."""
    logits = jnp.log(probabilities.astype(jnp.float32))
    if replacement:
        lead = logits.shape[:-1]
        drawn = jax.random.categorical(key, logits, axis=-1, shape=(samples, *lead))
        return jnp.moveaxis(drawn, 0, -1)
    gumbel = jax.random.gumbel(key, logits.shape)
    return jax.lax.top_k(logits + gumbel, samples)[1]


@register(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise(key, x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, *, generator=None):
    """Returns (output, noise). Training: each negative element is scaled by its own slope drawn
    U(lower, upper), recorded in noise (1 where x >= 0); eval: the mean slope, noise unchanged."""
    if not training:
        return jnp.where(x >= 0, x, x * ((lower + upper) / 2)), noise
    slope = jax.random.uniform(key, x.shape, jnp.float32, lower, upper).astype(x.dtype)
    noise = jnp.where(x >= 0, jnp.ones_like(x), slope)
    return x * noise, noise


@register(aten.poisson.default, random=True)
def poisson(key, rates, *, generator=None):
    # torch gives the draw no gradient; the integer draw gives none through the cast
    rates = _varying_like(jax.lax.stop_gradient(rates), key)
    return jax.random.poisson(key, rates, rates.shape).astype(rates.dtype)


@register(aten._standard_gamma.default, random=True)
def standard_gamma(key, alpha, *, generator=None):
    """Gamma(alpha, 1) draws; the gradient is the implicit reparameterization torch's
    `_standard_gamma_grad` also computes."""
    alpha = _varying_like(alpha, key)
    return jax.random.gamma(key, alpha, alpha.shape, alpha.dtype)


@register(aten.binomial.default, random=True)
def binomial(key, count, probabilities, *, generator=None):
    if varying_axes(key):
        # JAX's binomial sampler builds loop state from constants, which shard_map rejects
        raise unsupported_arg("aten.binomial", "a per-device key (inside the fused train step); draw it in "
                              "tpudist.compile(module) or outside the step")
    count = _varying_like(jax.lax.stop_gradient(count), key)
    probabilities = _varying_like(jax.lax.stop_gradient(probabilities), key)
    shape = jnp.broadcast_shapes(count.shape, probabilities.shape)
    return jax.random.binomial(key, count, probabilities, shape, jnp.float32).astype(count.dtype)


def _varying_like(value, key):
    """`value` made to vary over the same shard_map axes as the key (inside the fused step the key is
    per device). JAX's rejection samplers (poisson, gamma, binomial) loop over a carry built from
    their parameters and updated with draws from the key; under shard_map both must vary alike."""
    missing = tuple(sorted(varying_axes(key) - varying_axes(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value



def _floating(x):
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def _random_top(dtype) -> int:
    """One past the largest value `random_()` draws: 2**digits + 1 for floating types."""
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1) + 1
    return int(jnp.iinfo(dtype).max) + 1


def _integers(key, x, low, high):
    # the bridge computes in 32 bits (int64 tensors are int32 inside, see _convert)
    if not -2 ** 31 <= low < high <= 2 ** 31:
        raise unsupported_arg("aten.random_", f"the range [{low}, {high}) (beyond 32-bit integers)")
    return jax.random.randint(key, x.shape, low, high, jnp.int32)


@register(aten._sample_dirichlet.default, random=True)
def sample_dirichlet(key, alpha, *, generator=None):
    """Dirichlet(alpha) draws over the last dimension: normalized Gamma(alpha_i) draws, with their
    implicit-reparameterization gradient."""
    return jax.random.dirichlet(key, _varying_like(alpha, key), alpha.shape[:-1], alpha.dtype)
