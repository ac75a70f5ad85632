"""Grouped matrix products: the ragged matmul mixture-of-experts layers run (each token's rows by
their expert's weight), lowered to XLA's ragged dot."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import register, register_named
from tpudist.compile._torch.lowering.ops._util import unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


@register(aten._grouped_mm.default)
def grouped_mm(x, weights, offsets=None, bias=None, out_dtype=None):
    """`torch._grouped_mm`: (rows, k) x (groups, k, n) with `offsets` the cumulative row counts of
    the groups (rows past the last offset give zeros; torch leaves them unwritten), or a batch of
    (groups, m, k) x (groups, k, n) without."""
    if bias is not None:
        raise unsupported_arg("aten._grouped_mm", "a bias")
    if x.ndim == 3 and weights.ndim == 3 and offsets is None:
        return jnp.matmul(x, weights, preferred_element_type=jnp.float32)
    if x.ndim != 2 or weights.ndim != 3 or offsets is None:
        raise unsupported_arg("aten._grouped_mm", f"a {x.ndim}-d input, {weights.ndim}-d weights and "
                              f"{'no' if offsets is None else ''} offsets (lowered: 2-d x 3-d with offsets, 3-d x 3-d)")
    return ragged(x, weights, offsets)


@register_named("transformers.grouped_mm_fallback.default")
def grouped_mm_fallback(x, weights, offsets):
    """`transformers`' grouped matmul (its mixture-of-experts layers under torch.export): the same
    product as `torch._grouped_mm` with offsets."""
    return ragged(x, weights, offsets)


def ragged(x, weights, offsets):
    ends = offsets.astype(jnp.int32)
    sizes = jnp.diff(ends, prepend=0)
    return lax.ragged_dot(x, weights, sizes, preferred_element_type=jnp.float32)
