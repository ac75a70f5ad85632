"""The fused step's lowered program kept between processes (the step cache's step entries).

`StoredStep.compile` stands in for tracing and lowering a signature's step (`CompiledStep`): the
step's key is its capture's key (`lowering._capture_cache`), the lowering's switches and the step
traced with the model's graph replaced by zeros of its outputs' shapes (`stand_in`): what the
optimizer, clipping, averaging, shardings and arguments make of it, at a fraction of the graph's
trace. A hit deserializes the stored `jax.export.Exported` and compiles it (an XLA cache hit); a
miss traces as always, exports, stores, and compiles the same exported program, so that the next
process's compile finds XLA's entry. A program `jax.export` refuses (a custom call it does not
guarantee stable) compiles as before, uncached.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tpudist.compile._efficiency import model_flops
from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch.lowering import _capture_cache
from tpudist.compile._torch.lowering._layers import min_layers
from tpudist.compile._torch.lowering._pipeline import Rows
from tpudist.compile._torch.train._body import StepOutputs

log = logging.getLogger("tpudist.compile")
# the JAX settings a trace reads (dtypes, precision, random bits): part of every step key
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")
jax.export.register_namedtuple_serialization(StepOutputs, serialized_name="tpudist.StepOutputs")


def stand_in(captured: Any) -> Callable[..., tuple]:
    """`run` (see `_lower.lower`) returning zeros of the graph's output shapes: the step around the
    model, for the key."""
    shapes = [None if v is None else (v[0], jax_dtype(v[1])) for v in captured.output_values]

    def run(tensors: Any, key: Any) -> tuple:
        # zeros varying over the mesh axes the inputs vary over, as the graph's outputs do (under shard_map)
        axes = tuple(sorted({axis for t in tensors
                             for axis in getattr(jax.typeof(t.stack if isinstance(t, Rows) else t), "vma", ())}))
        zeros = [None if s is None else jnp.zeros(*s) for s in shapes]
        return tuple(z if z is None or not axes else jax.lax.pvary(z, axes) for z in zeros)

    return run


class StoredStep:
    """One signature's entry in the step cache (see the module docstring); `hit` says whether the
    last compile came from it."""

    def __init__(self, capture_key: str, stand_in_body: Callable[..., Any]):
        settings = tuple((name, str(getattr(jax.config, name, None))) for name in _JAX_SETTINGS)
        self.prefix = f"{capture_key}|scan={min_layers()}|{settings}"
        self.stand_in_body = stand_in_body
        self.hit = False

    def compile(self, step: Any, jitted: Any, donate: tuple[int, ...], dynamic: list[Any], statics: tuple,
                nargs: int) -> tuple[Any, float | None] | None:
        """(executable, flops) for `jitted` (the step's jit of its body) on `dynamic`; None where the
        step is to be compiled as always (no key, or a program jax.export refuses)."""
        self.hit = False
        try:
            key = self._key(step, donate, dynamic, statics, nargs)
        except Exception as exc:  # noqa: BLE001 - a step the stand-in cannot trace is compiled as always
            log.debug("tpudist: step cache: no key for %s: %s: %s", step.name, type(exc).__name__, exc)
            return None
        entry = _capture_cache.load("step", key)
        if entry is not None:
            try:
                exported = jax.export.deserialize(bytearray(entry["exported"]))
            except Exception as exc:  # noqa: BLE001 - a foreign entry is a miss
                log.warning("tpudist: ignoring an unreadable step cache entry %s.step: %s", key, exc)
            else:
                self.hit = True
                return jax.jit(exported.call, donate_argnums=donate).lower(*dynamic).compile(), entry["flops"]
        try:
            exported = jax.export.export(jitted)(*dynamic)
            blob = bytes(exported.serialize())
        except Exception as exc:  # noqa: BLE001 - jax.export's refusals: compiled as always, not stored
            log.debug("tpudist: step cache: %s is not stored: %s: %s", step.name, type(exc).__name__, exc)
            return None
        flops = model_flops(jitted.trace(*dynamic).jaxpr, step.mesh.devices.size)  # (the trace export made)
        _capture_cache.store("step", key, {"exported": blob, "flops": flops})
        return jax.jit(exported.call, donate_argnums=donate).lower(*dynamic).compile(), flops

    def _key(self, step: Any, donate: tuple[int, ...], dynamic: list[Any], statics: tuple, nargs: int) -> str:
        body, _ = step._wrapped(self.stand_in_body, dynamic, statics, nargs)
        skeleton = jax.jit(body, donate_argnums=donate).trace(*dynamic).jaxpr
        leaves = jax.tree_util.tree_leaves(dynamic)
        arrays = [(x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), repr(getattr(x, "sharding", None)))
                  for x in leaves]
        mesh = (step.mesh.axis_names, step.mesh.devices.shape, [(d.id, d.platform) for d in step.mesh.devices.flat])
        digest = hashlib.sha256(f"{self.prefix}|{step.per_device}|{donate}|{mesh}|{arrays}|{statics}".encode())
        digest.update(str(skeleton).encode())
        return digest.hexdigest()
