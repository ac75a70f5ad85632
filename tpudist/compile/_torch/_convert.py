"""Crossing between torch tensors and JAX arrays: dtypes and DLPack.

The bridge computes in 32 bits, as JAX does by default (`jax_enable_x64` off): int64 tensors
(indices, counters) enter as int32 and float64 as float32; results go back in the dtype eager torch
would have produced. Same-width tensors cross through DLPack, zero-copy on CPU.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import numpy as np
import torch
import torch.utils.dlpack

from tpudist._buffers import narrowed, torch_dtypes, torch_view
from tpudist._jaxcompat import import_buffer

# the dtypes torch narrows before crossing, to the one JAX computes in (`to_jax`'s hot path: one lookup)
_NARROW = {t: getattr(torch, narrowed(d).name) for t, d in torch_dtypes().items() if narrowed(d) != d}


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The dtype JAX computes `dtype` in, e.g. `torch.int64 -> int32`."""
    found = torch_dtypes().get(dtype)
    if found is None:
        raise TypeError(f"torch -> XLA: tensors of dtype {dtype} are not supported; "
                        f"supported dtypes: {', '.join(str(d) for d in torch_dtypes())}")
    return narrowed(found)


def to_jax(tensor: torch.Tensor, copy: bool = False, device: Any = None) -> jax.Array:
    """A JAX array with `tensor`'s values; shares memory with it unless `copy` or a narrowing applies.

    A shared array must not be read after torch writes the tensor in place; callers pass
    `copy=True` for tensors the compiled graph itself will update (mutated buffers). `device` is
    where the array lives; by default a CPU tensor goes to this process's first CPU device and a
    CUDA tensor stays on its GPU (JAX's GPU backend, through DLPack).
    """
    t = tensor.detach() if tensor.requires_grad else tensor  # (detach costs a few us: only when needed)
    if t.dtype in _NARROW:
        t = t.to(_NARROW[t.dtype])
    elif copy:
        t = t.clone()
    if not t.is_contiguous():
        t = t.contiguous()
    target = device or _cpu_device()
    if t.device.type == "cpu" and target.platform == "cpu":
        # the direct import, ~10x cheaper than from_dlpack; torch's C-level capsule export skips
        # Tensor.__dlpack__'s Python checks (which hold here: detached, CPU, no stream)
        array = import_buffer(torch.utils.dlpack.to_dlpack(t), target)
        if array is not None:
            return array
    array = jax.dlpack.from_dlpack(t)
    return array if device is None else jax.device_put(array, device)


@functools.lru_cache(maxsize=1)
def _cpu_device() -> Any:
    return jax.local_devices(backend="cpu")[0]


def to_torch(array: jax.Array, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor viewing `array` (zero-copy), widened to `dtype` when the bridge narrowed it.

    The caller must drop every other reference to `array`: torch may write the tensor in place
    (gradient accumulation does), which JAX, treating arrays as immutable, would not expect.
    """
    tensor = torch_view(array)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


_DTYPE = operator.attrgetter("dtype")


class ViewCache:
    """JAX views of long-lived tensors (parameters, buffers, constants), made once per storage.

    A zero-copy view sees torch's in-place writes (optimizer steps) without being rebuilt, so only
    a tensor that was replaced or re-pointed (`p.data = ...`) needs a new one; the key (tensor
    identity, data pointer, shape, strides, dtype) notices both. Copies (narrowed dtypes) are
    never cached: they would go stale.
    """

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, tuple, jax.Array]] = {}
        self._last: tuple | None = None  # get_all's tensors, their keys and arrays, when all were views

    def get_all(self, slots: list[int], tensors: list[torch.Tensor]) -> list[jax.Array]:
        """`get` for many tensors at once. While they are the same tensors at the same data pointers,
        sizes, strides and dtypes as last time, the same arrays, checked with C-level maps (~0.25 us
        a tensor, against ~1.5 us for `get` one by one: dynamo passes every parameter on every call)."""
        key = (list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.size, tensors)),
               list(map(torch.Tensor.stride, tensors)), list(map(_DTYPE, tensors)))
        last = self._last
        if last is not None and last[1] == key and len(last[0]) == len(tensors) and all(
                map(operator.is_, tensors, last[0])):
            return last[2]
        arrays = [self.get(slot, tensor) for slot, tensor in zip(slots, tensors)]
        views = all(self._views.get(slot, (None, None, None))[2] is array for slot, array in zip(slots, arrays))
        self._last = (list(tensors), key, arrays) if views else None
        return arrays

    def get(self, slot: int, tensor: torch.Tensor) -> jax.Array:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        cached = self._views.get(slot)
        if cached is not None and cached[0] is tensor and cached[1] == key:
            return cached[2]
        array = to_jax(tensor)
        if array.unsafe_buffer_pointer() == tensor.data_ptr():
            self._views[slot] = (tensor, key, array)
        return array
