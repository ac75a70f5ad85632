"""Discrete Fourier transforms (torch.fft): the ATen _fft_r2c / _fft_c2c / _fft_c2r ops, lowered to XLA's FFT.

torch.fft's functions reach these three ops with the transformed dims, a normalization mode (0: none,
1: by 1/sqrt(n), 2: by 1/n, n the product of the signal sizes) and, for real signals, whether only
the non-negative frequencies are kept (`onesided`, halving the last transformed dim).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


# JAX's `norm=` names which direction is scaled: "backward" scales only the inverse by 1/n,
# "forward" only the forward transform, "ortho" both by 1/sqrt(n)
_FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}


def _axes(op: str, x, dim, normalization) -> tuple[int, ...]:
    if normalization not in _FORWARD_NORM:
        raise unsupported_arg(op, f"normalization={normalization!r}")
    return tuple(d % x.ndim for d in dim)


@register(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    axes = _axes("aten._fft_r2c", x, dim, normalization)
    if not axes:
        return x.astype(jnp.complex64)
    if onesided:
        return jnp.fft.rfftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.fftn(x.astype(jnp.complex64), axes=axes, norm=_FORWARD_NORM[normalization])


@register(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    axes = _axes("aten._fft_c2c", x, dim, normalization)
    if not axes:
        return x
    if forward:
        return jnp.fft.fftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=axes, norm=_INVERSE_NORM[normalization])


@register(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    axes = _axes("aten._fft_c2r", x, dim, normalization)
    # the input holds the non-negative half of the last transformed dim (as irfftn expects it);
    # the imaginary parts a real signal's spectrum cannot have are ignored, as by torch's kernels
    sizes = [x.shape[d] for d in axes[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=axes, norm=_INVERSE_NORM[normalization])
