"""Compiled steps: the implementation behind `tpudist.compile` (JAX functions and torch.nn.Modules),
sharded embeddings, the persistent compilation cache, and the fused torch train step.

`tpudist.compile` itself is a function (`tpudist/compile/_dispatch.py`); this package's public
names are also exported from `tpudist` (`tpudist.compile_train_step`, `tpudist.UnsupportedOpError`,
...) and importable from here (`from tpudist.compile import supported_torch_ops`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compile": "tpudist.compile._dispatch",
    "dynamo_stats": "tpudist.compile._torch.module._dynamo",
    "DynamoStats": "tpudist.compile._torch.module._dynamo",
    "explain": "tpudist.compile._torch.module._explain",
    "Explanation": "tpudist.compile._torch.module._explain",
    "compile_stats": "tpudist.compile._jax_step",
    "CompileStats": "tpudist.compile._jax_step",
    "CompiledStep": "tpudist.compile._jax_step",
    "ShardedEmbedding": "tpudist.compile._embedding",
    "compile_train_step": "tpudist.compile._torch.train._fused",
    "TrainStep": "tpudist.compile._torch.train._fused",
    "Sharding": "tpudist.compile._torch._sharding",
    "tp_plan": "tpudist.compile._torch._sharding",
    "parallelize": "tpudist.compile._torch._layout",
    "layout": "tpudist.compile._torch._layout",
    "Layout": "tpudist.compile._torch._layout",
    "generate": "tpudist.compile._torch.serve._generate",
    "predict": "tpudist.compile._torch.serve._predict",
    "generate_stats": "tpudist.compile._torch.serve._generate",
    "GenerateStats": "tpudist.compile._torch.serve._generate",
    "device_loader": "tpudist.compile._torch.train._loader",
    "DeviceBatch": "tpudist.compile._torch.train._loader",
    "LazyScalar": "tpudist.compile._torch.train._lazy",
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
