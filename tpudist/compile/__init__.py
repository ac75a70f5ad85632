"""Compiled steps: `tpudist.compile` for JAX functions and torch.nn.Modules, sharded embeddings,
the persistent compilation cache, and PyTorch training helpers."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "compile": "tpudist.compile._dispatch",
    "compile_stats": "tpudist.compile._jax_step",
    "CompileStats": "tpudist.compile._jax_step",
    "ShardedEmbedding": "tpudist.compile._embedding",
    "optimizer_step": "tpudist.compile._torch_train",
    "compile_train_step": "tpudist.compile._torch_train",
    "fit": "tpudist.compile._torch_train",
    "eager_step": "tpudist.compile._torch_train",
    "TrainStep": "tpudist.compile._torch._fused",
    "supported_torch_ops": "tpudist.compile._torch",
    "UnsupportedOpError": "tpudist.compile._torch",
    "CaptureError": "tpudist.compile._torch",
    "CompiledModule": "tpudist.compile._torch",
    "TorchCompileStats": "tpudist.compile._torch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpudist.compile' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """`tpudist.compile` is both this subpackage and the function: importing any
    `tpudist.compile.*` module binds the attribute `tpudist.compile` to the module, so the module
    itself is callable and forwards to `compile`."""

    def __call__(self, fn: Any, **kwargs: Any) -> Any:
        from tpudist.compile._dispatch import compile as compile_
        return compile_(fn, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
