"""tpudist: a distributed pod launcher and XLA collectives runtime for PyTorch and JAX.

    import tpudist
    tpudist.init()                                  # joins the job the launcher started
    g = tpudist.all_reduce(grad, op="mean")         # torch / numpy / jax in, same type out
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})
    step = tpudist.compile(train_step, mesh=mesh)   # a JAX function, SPMD over the mesh
    model = tpudist.compile(torch_model)            # a torch.nn.Module, on this process's accelerator
    step = tpudist.compile_train_step(torch_model, loss_fn, optimizer, mesh=mesh)  # fused, sharded

Names are imported lazily, so `import tpudist` (and the launcher) does not import jax or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# `tpudist.compile` is this function; importing it first binds the subpackage `tpudist.compile` (its
# implementation, importable as `from tpudist.compile import ...`) once, and the name then to the function
from tpudist.compile._dispatch import compile  # noqa: F401  (re-exported)

from tpudist._version import __version__  # noqa: F401  (re-exported)

# public name -> module that defines it
_EXPORTS = {
    # runtime
    "init": "tpudist._runtime",
    "shutdown": "tpudist._runtime",
    "is_initialized": "tpudist._runtime",
    "process_index": "tpudist._runtime",
    "process_count": "tpudist._runtime",
    "local_process_index": "tpudist._runtime",
    "local_process_count": "tpudist._runtime",
    "devices": "tpudist._runtime",
    "local_devices": "tpudist._runtime",
    "slice_index": "tpudist._runtime",
    "num_slices": "tpudist._runtime",
    "spawn": "tpudist._spawn",
    "SpawnError": "tpudist._spawn",
    # eager and in-graph collectives
    "all_reduce": "tpudist.collectives",
    "all_gather": "tpudist.collectives",
    "reduce_scatter": "tpudist.collectives",
    "all_to_all": "tpudist.collectives",
    "broadcast": "tpudist.collectives",
    "collective_permute": "tpudist.collectives",
    "barrier": "tpudist.collectives",
    "CollectiveError": "tpudist.collectives",
    "CollectiveTimeout": "tpudist.collectives",
    "collective_stats": "tpudist.collectives",
    "CollectiveStats": "tpudist.collectives",
    # compiled steps
    "dynamo_stats": "tpudist.compile",
    "explain": "tpudist.compile",
    "Explanation": "tpudist.compile",
    "compile_stats": "tpudist.compile",
    "CompileStats": "tpudist.compile",
    "ShardedEmbedding": "tpudist.compile",
    "compile_train_step": "tpudist.compile",
    "TrainStep": "tpudist.compile",
    "Sharding": "tpudist.compile",
    "tp_plan": "tpudist.compile",
    "parallelize": "tpudist.compile",
    "layout": "tpudist.compile",
    "Layout": "tpudist.compile",
    "generate": "tpudist.compile",
    "predict": "tpudist.compile",
    "generate_stats": "tpudist.compile",
    "GenerateStats": "tpudist.compile",
    "device_loader": "tpudist.compile",
    "DeviceBatch": "tpudist.compile",
    "LazyScalar": "tpudist.compile",
    "supported_torch_ops": "tpudist.compile",
    "UnsupportedOpError": "tpudist.compile",
    "CaptureError": "tpudist.compile",
    "CompiledModule": "tpudist.compile",
    # seeing inside: traces, spans, TensorBoard scalars
    "profile": "tpudist._profile",
    "start_profile": "tpudist._profile",
    "stop_profile": "tpudist._profile",
    "span": "tpudist._profile",
    "traced": "tpudist._profile",
    "profiling": "tpudist._profile",
    "ScalarLog": "tpudist._metrics",
    "read_scalars": "tpudist._metrics",
    # training loops
    "optimizer_step": "tpudist.compile._torch.train._fit",
    "fit": "tpudist.compile._torch.train._fit",
    "eager_step": "tpudist.compile._torch.train._fit",
}
_SUBMODULES = ("mesh", "collectives", "checkpoint", "launch", "testing", "nn", "contract")

__all__ = sorted([*_EXPORTS, "compile"]) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"tpudist.{name}")
    raise AttributeError(f"module 'tpudist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
