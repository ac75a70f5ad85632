"""Special functions and the rest of the elementwise family: inverse hyperbolics, gamma and Bessel functions, orthogonal polynomials, floating-point manipulation (copysign, nextafter, frexp, ldexp), complex construction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.compile._torch._registry import register

aten = torch.ops.aten
