"""Matrix products. Precision is XLA's default for the platform (full fp32 on CPU; on TPU, f32
matmuls use bf16 passes unless `jax_default_matmul_precision` says otherwise, as torch_xla does)."""

from __future__ import annotations

import jax.numpy as jnp

from tpudist.compile._torch._registry import register

aten = __import__("torch").ops.aten


def _scaled(value, factor):
    return value if factor == 1 else value * factor


@register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(a, b):
    return jnp.matmul(a, b)


@register(aten.mv.default)
def mv(a, v):
    return jnp.matmul(a, v)


@register(aten.dot.default)
def dot(a, b):
    return jnp.dot(a, b)


@register(aten.addmm.default, aten.baddbmm.default)
def addmm(bias, a, b, *, beta=1, alpha=1):
    product = _scaled(jnp.matmul(a, b), alpha)
    return product if beta == 0 else _scaled(bias, beta) + product


@register(aten.addmv.default)
def addmv(bias, a, v, *, beta=1, alpha=1):
    product = _scaled(jnp.matmul(a, v), alpha)
    return product if beta == 0 else _scaled(bias, beta) + product
