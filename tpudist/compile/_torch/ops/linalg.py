"""Matrix products. Precision is XLA's default for the platform (full fp32 on CPU; on TPU, f32
matmuls use bf16 passes unless `jax_default_matmul_precision` says otherwise, as torch_xla does).

Half-precision products (bfloat16 / float16, e.g. under `torch.autocast`) accumulate in float32,
add their bias in float32 and round once, as torch's CPU and CUDA kernels (and a TPU's MXU) do;
the interpreter casts the float32 result back to the dtype torch recorded.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch._registry import register

aten = __import__("torch").ops.aten


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
