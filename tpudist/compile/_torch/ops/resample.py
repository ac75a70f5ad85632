"""Resampling: interpolation (F.interpolate in every mode torch has) and grid sampling, with the gradients JAX derives from them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.compile._torch._registry import register

aten = torch.ops.aten
