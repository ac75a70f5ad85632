"""Crossing between torch tensors and JAX arrays: dtypes, DLPack, and the device a call computes on.

The bridge computes in 32 bits, as JAX does by default (`jax_enable_x64` off): int64 tensors
(indices, counters) enter as int32 and float64 as float32; results go back in the dtype eager torch
would have produced. Same-width tensors cross through DLPack, zero-copy on CPU.

A compiled module computes on JAX's default device as it is at each call (`compute_device`): the
accelerator where there is one, so torch's CPU tensors are copied to it, long-lived ones kept
resident (`ViewCache`), and results copied back to the host (`to_host`); on XLA:CPU torch views
the arrays and nothing is copied. CUDA tensors stay on their GPU (`where`).
"""

from __future__ import annotations

import functools
import operator
import os
from typing import Any, NamedTuple

import jax
import numpy as np
import torch
import torch.utils.dlpack

from tpudist import contract
from tpudist._buffers import narrowed, numpy_view, torch_dtypes, torch_view
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
    """A JAX array with `tensor`'s values on `device`; shares memory with it where it can.

    `device` is where the array lives; None: a CPU tensor goes to `compute_device()`, a CUDA tensor
    stays on its GPU (JAX's GPU backend, through DLPack). A CPU tensor bound for a device torch
    can view (XLA:CPU, unless `HOST_VIEW` is False) is wrapped without a copy unless `copy` or a
    narrowing applies; a shared array must not be read after torch writes the tensor in place, so
    callers pass `copy=True` for tensors the compiled graph itself will update (mutated buffers).
    Elsewhere (a TPU, a GPU) it is one host-to-device copy.
    """
    t = tensor.detach() if tensor.requires_grad else tensor  # (detach costs a few us: only when needed)
    host = t.device.type == "cpu"
    target = (device or compute_device()) if host else device
    shared = not host or viewable(target)  # else the transfer below copies anyway (DLPack shares CUDA memory)
    if t.dtype in _NARROW:
        t = t.to(_NARROW[t.dtype])
    elif copy and shared:
        t = t.clone()
    if not t.is_contiguous():
        t = t.contiguous()
    if host:
        if not shared:
            # a distinct buffer even on XLA:CPU (whose device_put of host memory shares it)
            values = numpy_view(t)
            return jax.device_put(values.copy() if target.platform == "cpu" else values, target)
        # the direct import, ~10x cheaper than from_dlpack; torch's C-level capsule export skips
        # Tensor.__dlpack__'s Python checks (which hold here: detached, CPU, no stream)
        array = import_buffer(torch.utils.dlpack.to_dlpack(t), target)
        if array is not None:
            return array
        array = jax.dlpack.from_dlpack(t)
        return jax.device_put(array, target)
    array = jax.dlpack.from_dlpack(t)
    return array if device is None else jax.device_put(array, device)


# False: torch is treated as unable to view XLA:CPU's memory, as on a TPU: parameters are copied and
# kept resident, outputs copied to the host (`TPUDIST_TORCH_HOST_VIEW=0`; the tests' way to run the
# accelerator's path on a CPU mesh). None: decided by the device's platform.
HOST_VIEW: bool | None = None if os.environ.get(contract.TORCH_HOST_VIEW, "1") != "0" else False


def viewable(device: Any) -> bool:
    """Whether torch shares memory with arrays on `device` (XLA:CPU's live in host memory)."""
    return device.platform == "cpu" and HOST_VIEW is not False


def compute_device() -> Any:
    """Where a compiled module computes on torch's CPU tensors: JAX's default device as it is now
    (`with jax.default_device(d):`, `jax.config.update("jax_default_device", d)`, a device or a
    platform name), else this process's first device of JAX's default backend: a TPU or GPU where
    there is one, the CPU where there is none.

    Example:
        with jax.default_device(jax.local_devices()[1]):
            compute_device()                    # jax.local_devices()[1]
    """
    chosen = jax.config.jax_default_device
    if chosen is None:
        return _first_device(None)
    if isinstance(chosen, str):
        return _first_device(chosen)
    return _checked(chosen)


@functools.lru_cache(maxsize=None)
def _first_device(platform: str | None) -> Any:
    devices = jax.local_devices(backend=platform)
    if not devices:
        raise ValueError(f"jax_default_device={platform!r}: this process has no {platform} device")
    return devices[0]


@functools.lru_cache(maxsize=64)
def _checked(device: Any) -> Any:
    if device.process_index != jax.process_index():
        raise ValueError(f"jax.default_device({device}) is a device of process {device.process_index}, not of this "
                         f"process ({jax.process_index()}); pick one of jax.local_devices()")
    return device


@functools.lru_cache(maxsize=None)
def host_device() -> Any:
    """The CPU device whose arrays torch views: where results computed elsewhere cross to torch
    (None where JAX runs without its CPU backend, e.g. JAX_PLATFORMS=tpu)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def to_host(arrays: list[Any]) -> list[Any]:
    """`arrays` copied where torch can view them: to `host_device()`, in one transfer (numpy
    copies where JAX runs without its CPU backend). The copies of arrays on an accelerator all
    start at once (`copy_to_host_async`) before the first is read: on a TPU each one read in turn
    paid a round trip (~0.5 ms), 11 per generated token of a 2-layer Llama."""
    for a in arrays:
        if isinstance(a, jax.Array) and a.is_fully_addressable and _off_host(a):
            a.copy_to_host_async()
    host = host_device()
    if host is None or not arrays:
        return [np.array(a) for a in arrays]
    # the stand-in (HOST_VIEW False on XLA:CPU): a copy, as from a TPU, not the device's own buffer
    return jax.device_put(arrays, host, may_alias=False if HOST_VIEW is False else None)


def _off_host(array: jax.Array) -> bool:
    return any(d.platform != "cpu" for d in array.devices())


class Where(NamedTuple):
    """Where one call of a compiled module computes: `device` runs its executables and holds its
    arrays; `host`: its results cross to the host for torch (torch's tensors are CPU tensors and
    torch cannot view `device`'s memory)."""

    device: Any
    host: bool


def where(cuda: torch.device | None) -> Where:
    """A call on torch's CUDA device `cuda` computes on that GPU, its results staying there; one on
    CPU tensors (`cuda` None) on `compute_device()` as it is now, crossing back unless viewable."""
    if cuda is not None:
        return Where(cuda_device(cuda), False)
    return _where(jax.config.jax_default_device, HOST_VIEW)  # one config read, one cached lookup (~1 us)


@functools.lru_cache(maxsize=64)
def _where(chosen: Any, host_view: bool | None) -> Where:
    device = compute_device()
    return Where(device, not viewable(device))


@functools.lru_cache(maxsize=None)
def cuda_device(device: torch.device) -> Any:
    """The JAX device holding torch's CUDA `device`'s memory (where DLPack puts its tensors)."""
    return next(iter(jax.dlpack.from_dlpack(torch.zeros(1, device=device)).devices()))


def to_torch(array: jax.Array, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor viewing `array` (zero-copy), widened to `dtype` when the bridge narrowed it.

    The caller must drop every other reference to `array`: torch may write the tensor in place
    (gradient accumulation does), which JAX, treating arrays as immutable, would not expect.
    """
    tensor = torch_view(array)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


_DTYPE = operator.attrgetter("dtype")
_VERSION = operator.attrgetter("_version")


class ViewCache:
    """JAX arrays of long-lived tensors (parameters, buffers, constants) on one device, made once
    and kept there between calls.

    On a device torch can view (XLA:CPU), and for CUDA tensors on their GPU, an array is a zero-copy
    view: it sees torch's in-place writes (optimizer steps) without being rebuilt, so only a tensor
    that was replaced or re-pointed (`p.data = ...`) needs a new one; the key (tensor identity, data
    pointer, shape, strides, dtype) notices both. Copies there (narrowed dtypes) are never cached:
    they would go stale. On any other device (a TPU, CPU tensors on a GPU) each array is a copy,
    resident on the device between calls and uploaded again only when torch changed the tensor: the
    key adds torch's version counter, which every in-place write bumps (optimizer steps,
    `load_state_dict`, `with torch.no_grad(): p.add_(1)`), as the fused step's state does; a write
    through `.data` (`p.data.mul_(2)`) is one torch does not count, so it is not seen. The arrays
    of one device are kept at a time: a call on another device replaces them.
    """

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, tuple, jax.Array]] = {}
        self._last: tuple | None = None  # get_all's tensors, their keys and arrays, when all were cached
        self.device: Any = None
        self._copies = False  # the arrays are resident copies (keyed by version), not views

    def get_all(self, slots: list[int], tensors: list[torch.Tensor], device: Any) -> list[jax.Array]:
        """`get` for many tensors at once. While they are the same tensors at the same data pointers,
        sizes, strides and dtypes (and versions, for copies) as last time, the same arrays, checked
        with C-level maps (~0.25 us a tensor, against ~1.5 us for `get` one by one: dynamo passes
        every parameter on every call)."""
        if device is not self.device:
            self._on(device, tensors)
        key = (list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.size, tensors)),
               list(map(torch.Tensor.stride, tensors)), list(map(_DTYPE, tensors)),
               list(map(_VERSION, tensors)) if self._copies else None)
        last = self._last
        if last is not None and last[1] == key and len(last[0]) == len(tensors) and all(
                map(operator.is_, tensors, last[0])):
            return last[2]
        arrays = [self.get(slot, tensor) for slot, tensor in zip(slots, tensors)]
        cached = all(self._views.get(slot, (None, None, None))[2] is array for slot, array in zip(slots, arrays))
        self._last = (list(tensors), key, arrays) if cached else None
        return arrays

    def get(self, slot: int, tensor: torch.Tensor) -> jax.Array:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype,
               tensor._version if self._copies else None)
        cached = self._views.get(slot)
        if cached is not None and cached[0] is tensor and cached[1] == key:
            return cached[2]
        array = to_jax(tensor, device=self.device)
        if self._copies or array.unsafe_buffer_pointer() == tensor.data_ptr():
            self._views[slot] = (tensor, key, array)
        return array

    def _on(self, device: Any, tensors: list[torch.Tensor]) -> None:
        """Moves the cache to `device`: the other device's arrays are dropped (freed there)."""
        self._views.clear()
        self._last = None
        self.device = device
        self._copies = not viewable(device) and not (tensors and tensors[0].device.type == "cuda")
