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


def _on_device(piece: Any, device: Any) -> jax.Array:
    if isinstance(piece, torch.Tensor):
        return to_jax(piece, device=device)
    array = import_buffer(piece, device) if device.platform == "cpu" else None
    return array if array is not None else jax.device_put(piece, device)
