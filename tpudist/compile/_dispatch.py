"""`tpudist.compile`: one entry point for JAX functions and torch.nn.Modules."""

from __future__ import annotations

import sys
from typing import Any


def compile(fn: Any, **kwargs: Any) -> Any:
    """Compiles a JAX function into an SPMD step, or a torch.nn.Module into an XLA-backed module.

    A `torch.nn.Module` goes through the torch -> XLA bridge (see `tpudist/compile/_torch`);
    anything else callable is treated as a JAX function (see `tpudist/compile/_jax_step.py`).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(fn, torch.nn.Module):
        from tpudist.compile._torch import compile_module
        return compile_module(fn, **kwargs)
    if not callable(fn):
        raise TypeError(f"tpudist.compile expects a JAX function or a torch.nn.Module, got {type(fn).__name__}")
    from tpudist.compile._jax_step import compile_jax
    return compile_jax(fn, **kwargs)
