"""Host memory that XLA:CPU computes on in place, one layer for the collectives and the torch bridge:
aligned buffers, the staging buffers a device array is imported from, zero-copy torch views of host
and CPU device buffers, and the one dtype table torch <-> numpy <-> jax.

torch is imported only once a torch value or view is asked for, so `import tpudist.collectives`
with numpy and jax alone does not import it; of tpudist this imports only `_jaxcompat`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tpudist._jaxcompat import export_buffer

ALIGNMENT = 64  # bytes: XLA:CPU shares (imports) host memory aligned to this and copies the rest

# numpy has no bfloat16 of its own; JAX's (ml_dtypes') is the one every host array here uses
BFLOAT16 = np.dtype(jax.numpy.bfloat16)

# Every dtype that crosses between torch, numpy and jax, by torch's name for it, in the order error
# messages list them; the numpy (= jax) dtype has the same width.
DTYPES = {name: BFLOAT16 if name == "bfloat16" else np.dtype(name) for name in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128")}

# The dtype JAX computes in with 64-bit types off (its default, the torch bridge's too).
NARROWED = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32),
            np.dtype(np.complex128): np.dtype(np.complex64)}

_by_torch: dict[Any, np.dtype] | None = None
_torch_module: Any = None


def _torch() -> Any:
    global _torch_module
    if _torch_module is None:
        import torch
        import torch.utils.dlpack
        _torch_module = torch
    return _torch_module


def torch_dtypes() -> dict[Any, np.dtype]:
    """torch dtype -> the numpy (and jax) dtype of the same width, for each of `DTYPES` (it imports
    torch: call it with a torch value in hand)."""
    global _by_torch
    if _by_torch is None:
        torch = _torch()
        _by_torch = {getattr(torch, name): dtype for name, dtype in DTYPES.items()}
    return _by_torch


def narrowed(dtype: np.dtype) -> np.dtype:
    """The dtype JAX computes `dtype` in by default, e.g. int64 -> int32."""
    return NARROWED.get(dtype, dtype)


def aligned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros whose memory starts on an `ALIGNMENT`-byte boundary, so that XLA shares it."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


SPIN_SECONDS = 50e-6  # how long a view of a device array polls for its result before it blocks


def torch_view(buffer: np.ndarray | jax.Array) -> Any:
    """A torch tensor sharing `buffer`'s memory: a host array (bfloat16 through its bits, numpy's
    being none torch knows) or a CPU `jax.Array`, once it is ready (DLPack)."""
    torch = _torch_module or _torch()
    if isinstance(buffer, np.ndarray):
        if buffer.dtype == BFLOAT16:
            return torch.from_numpy(buffer.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(buffer)
    if not buffer.is_ready():
        # XLA:CPU runs executables on its own threads; blocking on the result costs a thread
        # wake-up (~20 us here, measured: a small MLP's forward+backward waited for 35 us against
        # 15 us polled), which is most of a small model's call. Poll briefly, then block.
        deadline = time.perf_counter() + SPIN_SECONDS
        while not buffer.is_ready() and time.perf_counter() < deadline:
            pass
    capsule = export_buffer(buffer)
    return torch.utils.dlpack.from_dlpack(capsule) if capsule is not None else torch.from_dlpack(buffer)


def numpy_view(tensor: Any) -> np.ndarray:
    """A host array sharing a contiguous CPU tensor's memory (bfloat16 through its bits)."""
    torch = _torch_module or _torch()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def share(host: np.ndarray, put: Callable[[np.ndarray], Any]) -> Any | None:
    """`put(host)`, an array made of `host` (imported onto a device, or split over several), where
    each of its local blocks lies in `host`'s memory; None where `put` gave None or XLA copied."""
    array = put(host)
    if array is None:
        return None
    begin, end = host.ctypes.data, host.ctypes.data + host.nbytes
    blocks = [shard.data for shard in array.addressable_shards]
    return array if all(begin <= b.unsafe_buffer_pointer() < end or b.size == 0 for b in blocks) else None


class HostBuffers:
    """Reused input buffers: aligned host arrays that XLA imported without a copy, so that a call
    stages its values by writing them in (one copy) instead of importing fresh buffers.

    A fresh buffer costs a call more than its import: XLA:CPU's executable waits for its definition
    (a 4-byte all_reduce on 2 processes: 0.56-0.66 ms against 0.37 ms; docs/collectives.md). The
    lifetime rule: the hosts are written only once nothing still reads the arrays. A caller that
    waits for every call's results (the collectives, under their lock) keeps it by construction;
    one that runs ahead of the device (the torch bridge) records each call's result (`used`) and
    waits for it (`wait`) before writing the buffers again. The memory lives as long as the arrays.
    """

    def __init__(self, hosts: list[np.ndarray], arrays: list[jax.Array]) -> None:
        self.hosts, self.arrays = hosts, arrays
        self.reader: jax.Array | None = None  # the last result computed from the arrays
        self._ranges = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in hosts]

    @classmethod
    def build(cls, like: Sequence[tuple[tuple[int, ...], Any]],
              put: Callable[[np.ndarray], Any]) -> HostBuffers | None:
        """Buffers of `like`'s (shape, dtype)s, made arrays by `put` (see `share`); None where one
        is not shared (a dtype DLPack cannot carry, such as numpy's bfloat16; another platform)."""
        hosts, arrays = [], []
        for shape, dtype in like:
            host = aligned(tuple(shape), dtype)
            array = share(host, put)
            if array is None:
                return None
            hosts.append(host)
            arrays.append(array)
        return cls(hosts, arrays)

    def fill(self, values: Sequence[np.ndarray]) -> list[jax.Array]:
        """The arrays, holding `values` (host arrays shaped like the buffers) now."""
        for host, value in zip(self.hosts, values):
            np.copyto(host, value)
        return self.arrays

    def used(self, reader: jax.Array | None) -> None:
        """`reader` is a result of the call that reads the arrays: `wait` waits for it."""
        self.reader = reader

    def busy(self) -> bool:
        """Whether a recorded reader may still be reading the arrays."""
        return self.reader is not None and not self.reader.is_ready()

    def wait(self) -> None:
        """Returns once the recorded reader is done (the buffers may then be written)."""
        if self.reader is not None:
            jax.block_until_ready(self.reader)
            self.reader = None

    def holds(self, array: jax.Array) -> bool:
        """Whether `array`'s memory lies in one of the buffers (an output aliasing an input)."""
        pointer = array.unsafe_buffer_pointer()
        return any(begin <= pointer < end for begin, end in self._ranges)
