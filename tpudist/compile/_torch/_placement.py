"""Where the fused step's arrays live: global arrays on a 1-D "data" mesh, built from this process's
pieces, and this process's part of them read back.

A value is either replicated (the same on every device: parameters, optimizer state, buffers) or
split (its rows divided over the devices in mesh order: the batch, `ShardedEmbedding` rows). The
processes' devices must be contiguous along the axis (how `make_mesh({"data": -1})` lays it out),
so that this process's rows are one contiguous block of the global array.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist._jaxcompat import assemble, import_buffer
from tpudist.compile._torch._convert import to_jax

AXIS = "data"


class Placement:
    """Global arrays of one mesh, assembled from and read back into this process's pieces."""

    def __init__(self, mesh: Any):
        if tuple(mesh.axis_names) != (AXIS,):
            raise ValueError(f"the fused train step runs data-parallel over a 1-D mesh with axis {AXIS!r}; "
                             f"got axes {tuple(mesh.axis_names)} (tpudist.mesh.make_mesh({{'data': -1}}))")
        me = jax.process_index()
        order = list(mesh.devices.flat)
        self.mesh = mesh
        self.devices = [d for d in order if d.process_index == me]
        first = order.index(self.devices[0])
        if order[first:first + len(self.devices)] != self.devices:
            raise ValueError(f"rank {me}: this process's devices are not contiguous along the mesh's "
                             f"{AXIS!r} axis; build the mesh with tpudist.mesh.make_mesh({{{AXIS!r}: -1}})")
        self.total = mesh.devices.size
        self.replicated = NamedSharding(mesh, P())
        self.split = NamedSharding(mesh, P(AXIS))
        self.cpu = all(d.platform == "cpu" for d in self.devices)
        # one device in all: a single-device array is what the executables take; assembling a
        # global array around it costs every call ~10 us more for nothing
        self.single = self.total == 1

    @property
    def local_count(self) -> int:
        return len(self.devices)

    def put(self, value: Any, split: bool) -> jax.Array:
        """This process's `value` (torch tensor, numpy array, Python number) as a global array:
        the same on every device, or its rows split over this process's devices. CPU tensors are
        wrapped without a copy; the caller must not write them while a step reads them."""
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            return value
        if not isinstance(value, torch.Tensor):
            value = np.asarray(value)
            value = np.ascontiguousarray(value, dtype=jax.dtypes.canonicalize_dtype(value.dtype))
        devices = self.devices
        if self.single:
            return _on_device(value, devices[0])
        if split:
            rows = value.shape[0] // len(devices)
            pieces = [value[i * rows:(i + 1) * rows] for i in range(len(devices))]
            shape = (rows * self.total, *value.shape[1:])
        else:
            pieces, shape = [value] * len(devices), tuple(value.shape)
        shards = [_on_device(piece, device) for piece, device in zip(pieces, devices)]
        return assemble(shape, self.split if split else self.replicated, shards)

    def local_blocks(self, array: jax.Array, split: bool) -> list[jax.Array]:
        """This process's part of a global array, as single-device arrays in row order (one for a
        replicated array: every local device holds the same)."""
        shards = array.addressable_shards
        if not split or len(shards) == 1:
            return [shards[0].data]
        return [s.data for s in sorted(shards, key=lambda s: s.index[0].start or 0)]


STAGE_MAX_BYTES = 256 * 1024  # per process and leaf; larger batches cross by import (no copy)


class Staging:
    """Reused device buffers for a batch's small tensors, on a CPU mesh: each step copies its
    values in (one memcpy, any int64 narrowed on the way) instead of importing fresh buffers.

    An imported buffer costs the step more than its import: the executable waits for the new
    buffer's definition on the device's queue (tens of microseconds, the whole step for a small
    model). Two sets alternate; before a set is written again, the step that read it is waited
    for (long done in a steady loop, where the host runs at most a step ahead)."""

    SETS = 2

    def __init__(self, placement: Placement, examples: list[torch.Tensor]):
        self.placement = placement
        self.sets: list[tuple[list[torch.Tensor], list[jax.Array]]] = []
        for _ in range(self.SETS):
            hosts, arrays = [], []
            for t in examples:
                dtype = jax.dtypes.canonicalize_dtype(_np_dtype(t.dtype))
                host = _aligned_zeros(tuple(t.shape), dtype)
                array = placement.put(host, split=True)
                if not _aliases(array, host, placement):
                    raise RuntimeError("staging buffer was copied, not shared, by the import")
                arrays.append(array)                  # XLA's buffers are the host array's memory
                hosts.append(torch.from_numpy(host))  # written through torch: one copy_ each
            self.sets.append((hosts, arrays))
        self._users: list[Any] = [None] * self.SETS
        self._next = 0

    @staticmethod
    def fits(placement: Placement, t: Any) -> bool:
        return (placement.cpu and isinstance(t, torch.Tensor) and t.device.type == "cpu"
                and t.numel() * t.element_size() <= STAGE_MAX_BYTES and _np_dtype(t.dtype) is not None)

    def put(self, tensors: list[torch.Tensor]) -> tuple[list[jax.Array], int]:
        """The staged global arrays holding `tensors` now, and the set's index (for `used`)."""
        index = self._next
        self._next = (index + 1) % self.SETS
        user = self._users[index]
        if user is not None:
            if not user.is_ready():
                jax.block_until_ready(user)
            self._users[index] = None
        hosts, arrays = self.sets[index]
        for host, t in zip(hosts, tensors):
            host.copy_(t.detach() if t.requires_grad else t)  # int64 narrowed to int32 on the way
        return arrays, index

    def used(self, index: int, result: Any) -> None:
        """`result` is an output of the step that reads set `index`: wait for it before reuse."""
        self._users[index] = result


def _aligned_zeros(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    """Zeros whose memory starts on an `align`-byte boundary: XLA shares (imports) only aligned
    host memory, and copies the rest."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _aliases(array: jax.Array, host: np.ndarray, placement: Placement) -> bool:
    """Whether every local block of `array` lies in `host`'s memory (the import shared it)."""
    begin, end = host.ctypes.data, host.ctypes.data + host.nbytes
    blocks = placement.local_blocks(array, split=True)
    return all(begin <= b.unsafe_buffer_pointer() < end or b.size == 0 for b in blocks)


def _np_dtype(dtype: torch.dtype) -> Any:
    from tpudist.compile._torch._convert import _TORCH_TO_NUMPY
    return _TORCH_TO_NUMPY.get(dtype)


def _on_device(piece: Any, device: Any) -> jax.Array:
    if isinstance(piece, torch.Tensor):
        return to_jax(piece, device=device)
    array = import_buffer(piece, device) if device.platform == "cpu" else None
    return array if array is not None else jax.device_put(piece, device)
