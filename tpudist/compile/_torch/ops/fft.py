"""Discrete Fourier transforms (torch.fft): the ATen _fft_r2c / _fft_c2c / _fft_c2r ops, lowered to XLA's FFT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.compile._torch._registry import register

aten = torch.ops.aten
