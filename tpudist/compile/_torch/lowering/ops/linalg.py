"""Matrix products and contractions (mm, addbmm, nn.Bilinear's _trilinear), diagonals, and p-norm
distances (cdist, pdist, dist). Precision is XLA's default for the platform (full fp32 on CPU; on TPU, f32
matmuls use bf16 passes unless `jax_default_matmul_precision` says otherwise, as torch_xla does).

Half-precision products (bfloat16 / float16, e.g. under `torch.autocast`) accumulate in float32,
add their bias in float32 and round once, as torch's CPU and CUDA kernels (and a TPU's MXU) do;
the interpreter casts the float32 result back to the dtype torch recorded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist.compile._torch.lowering._table import decompose_with_torch, register
from tpudist.compile._torch.lowering.ops._util import custom_vjp
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _scaled(value, factor):
    return value if factor == 1 else value * factor


def accumulation(*operands) -> dict:
    """Keyword arguments making a product of `operands` accumulate in float32 when they are half."""
    half = any(getattr(o, "dtype", None) in (jnp.bfloat16, jnp.float16) for o in operands)
    return {"preferred_element_type": jnp.float32} if half else {}


def product(a, b):
    """`a @ b` (numpy matmul semantics) with half-precision inputs accumulated in float32."""
    return jnp.matmul(a, b, **accumulation(a, b))


def contract_last(a, w):
    """`a @ w.T` for a 2-d `w`, contracting w's second dim directly (see _lower's linear rule)."""
    return lax.dot_general(a, w, (((a.ndim - 1,), (1,)), ((), ())), **accumulation(a, w))


def with_bias(bias, value):
    """`bias + value`, in float32 when the product was accumulated in float32."""
    if bias is None:
        return value
    return bias.astype(value.dtype) + value if value.dtype == jnp.float32 else bias + value


@register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(a, b):
    return product(a, b)


@register(aten.mv.default)
def mv(a, v):
    return product(a, v)


@register(aten.dot.default)
def dot(a, b):
    return product(a, b)


@register(aten.addmm.default, aten.baddbmm.default)
def addmm(bias, a, b, *, beta=1, alpha=1):
    result = _scaled(product(a, b), alpha)
    return result if beta == 0 else with_bias(_scaled(bias, beta), result)


@register(aten.addmv.default)
def addmv(bias, a, v, *, beta=1, alpha=1):
    result = _scaled(product(a, v), alpha)
    return result if beta == 0 else with_bias(_scaled(bias, beta), result)


@register(aten.addbmm.default)
def addbmm(bias, batch1, batch2, *, beta=1, alpha=1):
    # the sum over the batch is one contraction, as bmm followed by a sum would compute it
    total = lax.dot_general(batch1, batch2, (((0, 2), (0, 1)), ((), ())), **accumulation(batch1, batch2))
    result = _scaled(total, alpha)
    return result if beta == 0 else with_bias(_scaled(bias, beta), result)


@register(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """`(i1 * i2 * i3).sum(sumdim)` after unsqueezing each input at its `expand` dims (nn.Bilinear's
    kernel), as one einsum: no broadcast product is materialized."""
    ndim = i1.ndim + len(expand1)
    operands, subscripts, sizes = [], [], [1] * ndim
    for x, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        for d in sorted(e % ndim for e in expand):
            x = jnp.expand_dims(x, d)
        # a dim of size 1 broadcasts: it is left out of the einsum like an expanded one
        kept = [d for d in range(ndim) if x.shape[d] != 1]
        operands.append(x.reshape([x.shape[d] for d in kept]))
        subscripts.append("".join(chr(97 + d) for d in kept))
        for d in kept:
            sizes[d] = x.shape[d]
    summed = {d % ndim for d in sumdim}
    out = [d for d in range(ndim) if d not in summed]
    used = set("".join(subscripts))
    spec = f"{','.join(subscripts)}->{''.join(chr(97 + d) for d in out if chr(97 + d) in used)}"
    result = jnp.einsum(spec, *operands, **accumulation(i1, i2, i3))
    return result.reshape([sizes[d] for d in out])


@register(aten.diagonal.default)
def diagonal(x, offset=0, dim1=0, dim2=1):
    # NumPy's diagonal is torch's: the diagonal becomes the last dim; an offset past the edge is empty
    return jnp.diagonal(x, offset, dim1 % x.ndim, dim2 % x.ndim)


# -- p-norm distances (cdist, pdist) -----------------------------------------------------------------

@functools.partial(custom_vjp, nondiff_argnums=(1,))
def _distance(diff, p: float):
    """The p-norm of `diff` over its last dim, differentiated as torch's cdist / pdist kernels do:
    zero gradient where the distance is zero, and for p < 1 where a coordinate difference is."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(a, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a ** p, axis=-1) ** (1 / p)


def _distance_fwd(diff, p):
    dist = _distance(diff, p)
    return dist, (diff, dist)


def _distance_bwd(p, residuals, g):
    diff, dist = residuals
    g, dist = g[..., None], dist[..., None]
    a, sign = jnp.abs(diff), jnp.sign(diff)
    safe = jnp.where(dist == 0, 1, dist)
    if p == 0:
        grad = jnp.zeros_like(diff)
    elif p == 1:
        grad = g * sign
    elif p == float("inf"):
        # every coordinate at the maximum gets the whole gradient (torch's kernel, not a share)
        grad = g * sign * (a == dist)
    elif p == 2:
        grad = jnp.where(dist == 0, 0, g * diff / safe)
    elif p < 2:
        grad = jnp.where(dist == 0, 0, sign * a ** (p - 1) * g / safe ** (p - 1))
        if p < 1:
            grad = jnp.where(diff == 0, 0, grad)
    else:
        grad = jnp.where(dist == 0, 0, diff * a ** (p - 2) * g / safe ** (p - 1))
    return (grad.astype(diff.dtype),)


_distance.defvjp(_distance_fwd, _distance_bwd)


# torch.dist is the vector norm of the difference (aten.linalg_vector_norm), gradient included
decompose_with_torch(aten.dist.default)


@register(aten._cdist_forward.default)
def cdist(x1, x2, p, compute_mode=None):
    # torch.cdist sends its matmul-based Euclidean path (compute_mode) to other ops; this one is
    # the direct difference, for every p
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    return _distance(x1[..., :, None, :] - x2[..., None, :, :], float(p))


@register(aten._pdist_forward.default)
def pdist(x, p=2):
    # the pairs (i, j), i < j, in row-major order of the upper triangle, as torch lists them
    i, j = np.triu_indices(x.shape[0], k=1)
    return _distance(x[i] - x[j], float(p))
