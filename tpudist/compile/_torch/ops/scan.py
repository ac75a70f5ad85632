"""Ordered and cumulative ops: cumulative reductions (cummax, cummin, logcumsumexp), searching sorted sequences, histograms and counting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.compile._torch._registry import register

aten = torch.ops.aten
