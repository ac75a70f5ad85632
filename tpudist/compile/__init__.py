"""Compiled steps: `tpudist.compile` for JAX functions and torch.nn.Modules, sharded embeddings,
the persistent compilation cache, and PyTorch training helpers."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compile": "tpudist.compile._dispatch",
    "compile_stats": "tpudist.compile._jax_step",
    "CompileStats": "tpudist.compile._jax_step",
    "ShardedEmbedding": "tpudist.compile._embedding",
    "optimizer_step": "tpudist.compile._torch_train",
    "compile_train_step": "tpudist.compile._torch_train",
    "fit": "tpudist.compile._torch_train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpudist.compile' has no attribute {name!r}")
