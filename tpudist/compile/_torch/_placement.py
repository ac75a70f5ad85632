"""Where the fused step's arrays live: global arrays on a 1-D "data" mesh, built from this process's
pieces, and this process's part of them read back.

A value is either replicated (the same on every device: parameters, optimizer state, buffers) or
split (its rows divided over the devices in mesh order: the batch, `ShardedEmbedding` rows). The
processes' devices must be contiguous along the axis (how `make_mesh({"data": -1})` lays it out),
so that this process's rows are one contiguous block of the global array.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist._jaxcompat import assemble, import_buffer
from tpudist.compile._torch._convert import _cpu_device, to_jax

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

    def put(self, value: Any, split: bool, copy: bool = False) -> jax.Array:
        """This process's `value` (torch tensor, numpy array, Python number) as a global array:
        the same on every device, or its rows split over this process's devices. CPU tensors are
        wrapped without a copy unless `copy`; a wrapped tensor must not be written while a step
        reads it, so a batch (which its owner may refill in place as soon as the step is queued)
        crosses with `copy=True`."""
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            return value
        if not isinstance(value, torch.Tensor):
            value = np.asarray(value)
            dtype = jax.dtypes.canonicalize_dtype(value.dtype)
            value = np.array(value, dtype, order="C") if copy else np.ascontiguousarray(value, dtype=dtype)
        devices = self.devices
        if self.single:
            return _on_device(value, devices[0], copy)
        if split:
            rows = value.shape[0] // len(devices)
            pieces = [value[i * rows:(i + 1) * rows] for i in range(len(devices))]
            shape = (rows * self.total, *value.shape[1:])
        else:
            pieces, shape = [value] * len(devices), tuple(value.shape)
        shards = [_on_device(piece, device, copy) for piece, device in zip(pieces, devices)]
        return assemble(shape, self.split if split else self.replicated, shards)

    def local_blocks(self, array: jax.Array, split: bool) -> list[jax.Array]:
        """This process's part of a global array, as single-device arrays in row order (one for a
        replicated array: every local device holds the same)."""
        shards = array.addressable_shards
        if not split or len(shards) == 1:
            return [shards[0].data]
        return [s.data for s in sorted(shards, key=lambda s: s.index[0].start or 0)]


STAGE_MAX_BYTES = 256 * 1024  # per process and leaf; larger inputs cross by import


class Staging:
    """Reused device buffers for a batch's small tensors, on a CPU mesh: each step copies its
    values in (one memcpy, any int64 narrowed on the way) instead of importing fresh buffers.

    An imported buffer costs the step more than its import: the executable waits for the new
    buffer's definition on the device's queue (tens of microseconds, the whole step for a small
    model). `sets` sets take turns; before a set is written again, the step that read it is
    waited for. Where the host runs ahead of the device (a small model's fused step), that wait
    is where the host sleeps, and the device must still have steps queued when it wakes. The
    32-256-4 MLP's step (pooled state) fell into a slow lockstep (77-121 us a step against ~55)
    in 3 of 6 runs with 2 sets and in 2 of 7 with 8; the fused step keeps 8. The hand-written
    JAX step swings as much on this machine (docs/torch.md, "Against the engine's own floor").

    When a set is still being read, the host waits for a later step instead: the one `QUEUED`
    steps before the step being staged. The sets read up to it free up together, so the host
    sleeps once every `sets - QUEUED + 1` steps instead of at every step, and the device still has
    the newest step queued while the host wakes. A thread back from a sleep works on cold caches:
    on the transformer block (5 ms steps) the calling thread's CPU per staged step fell from
    417-520 us to 183-209 us, the same as given the batch on the devices or as the hand-written
    JAX step. With 2 sets this is the plain wait for the set's own reader."""

    QUEUED = 2

    def __init__(self, placement: Placement, examples: list[torch.Tensor], sets: int = 2):
        self.placement = placement
        self.sets: list[tuple[list[torch.Tensor], list[jax.Array]]] = []
        for _ in range(sets):
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
        self._users: list[Any] = [None] * sets
        self._next = 0

    @staticmethod
    def fits(placement: Placement, t: Any) -> bool:
        # not 0-d (a 0-d NumPy host array imports as shape (1,)) nor bfloat16 (no torch view of
        # NumPy's): those cross by import
        return (placement.cpu and isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
                and t.numel() * t.element_size() <= STAGE_MAX_BYTES and t.dtype != torch.bfloat16
                and _np_dtype(t.dtype) is not None)

    def put(self, tensors: list[torch.Tensor]) -> tuple[list[jax.Array], int]:
        """The staged global arrays holding `tensors` now, and the set's index (for `used`)."""
        index, count = self._next, len(self.sets)
        self._next = (index + 1) % count
        user = self._users[index]
        if user is not None:
            if not user.is_ready():
                later = self._users[(index - self.QUEUED) % count]
                if later is not None:
                    jax.block_until_ready(later)
                jax.block_until_ready(user)  # ready by now where steps run in order
            self._users[index] = None
        hosts, arrays = self.sets[index]
        for host, t in zip(hosts, tensors):
            host.copy_(t.detach() if t.requires_grad else t)  # int64 narrowed to int32 on the way
        return arrays, index

    def used(self, index: int, result: Any) -> None:
        """`result` is an output of the step that reads set `index`: wait for it before reuse."""
        self._users[index] = result


class InputStaging:
    """Reused device buffers for the small CPU inputs of a compiled module's executables (its
    inputs, the cotangents its backward takes), copied into on each call.

    A freshly imported input makes XLA:CPU's executable wait for the buffer's definition (measured
    on the 32-16-4 MLP with its loss: 170-200 us a call against 60-70 us with reused buffers; the
    fused step's `Staging`, which this wraps, has the details). Reuse is safe while no output or
    residual of the executable is one of the buffers, which the first staged call checks (`check`),
    and while nothing reads a buffer when the next call writes it: two sets alternate, and each
    waits for the call that last read it. A call from a second thread while one is staging takes
    the plain import path.
    """

    def __init__(self, slots: tuple[int, ...], staging: Staging, signature: list[tuple[Any, torch.dtype]]):
        self.slots, self._staging, self._signature = slots, staging, signature
        self._lock = threading.Lock()
        self._index = -1
        self._ranges = [(h.data_ptr(), h.data_ptr() + h.numel() * h.element_size())
                        for hosts, _ in staging.sets for h in hosts]
        self.checked, self._aliased = False, False

    @classmethod
    def build(cls, tensors: list[torch.Tensor], slots: list[int]) -> InputStaging | None:
        """Staging for `tensors[i]` of every i in `slots` (shapes and dtypes as now), or None where
        one does not fit (too large, not on the CPU) or this platform would copy on import."""
        placement = _one_device_placement()
        if not slots or not all(Staging.fits(placement, tensors[i]) for i in slots):
            return None
        try:
            return cls(tuple(slots), Staging(placement, [tensors[i] for i in slots]),
                       [(tensors[i].shape, tensors[i].dtype) for i in slots])
        except RuntimeError:  # this platform copies host memory on import: nothing to reuse
            return None

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` (all of them, in slot order) have the shapes and dtypes staged."""
        return len(tensors) == len(self._signature) and all(
            t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
            for t, (shape, dtype) in zip(tensors, self._signature))

    def acquire(self, tensors: list[torch.Tensor]) -> dict[int, jax.Array] | None:
        """The staged arrays holding `tensors[i]`, by slot i; None when another thread is staging
        (the caller imports afresh). A successful acquire must be followed by `release`."""
        if not self._lock.acquire(blocking=False):
            return None
        arrays, self._index = self._staging.put([tensors[i] for i in self.slots])
        return dict(zip(self.slots, arrays))

    def release(self, output: jax.Array | None) -> bool:
        """Ends a staged call that produced `output` (None: it failed). False when the buffers must
        not be reused: an output aliases one, or a failed call may still be reading them."""
        self._staging.used(self._index, output)
        self._lock.release()
        return output is not None and not self._aliased

    def check(self, outputs: list[Any]) -> None:
        """Sees every output of the first staged call: reuse stops if one of them is a staging
        buffer (this JAX copies, but a JAX that forwarded inputs to outputs would not)."""
        self.checked = True
        self._aliased = any(isinstance(o, jax.Array) and not o.is_deleted() and any(
            begin <= o.unsafe_buffer_pointer() < end for begin, end in self._ranges) for o in outputs)


@functools.lru_cache(maxsize=1)
def _one_device_placement() -> Placement:
    """A placement on this process's first CPU device alone (a compiled module's executables)."""
    from jax.sharding import Mesh
    return Placement(Mesh(np.array([_cpu_device()]), (AXIS,)))


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


def _on_device(piece: Any, device: Any, copy: bool = False) -> jax.Array:
    if isinstance(piece, torch.Tensor):
        return to_jax(piece, copy=copy, device=device)
    array = import_buffer(piece, device) if device.platform == "cpu" else None
    return array if array is not None else jax.device_put(piece, device)
