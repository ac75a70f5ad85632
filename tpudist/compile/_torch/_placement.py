"""Where the fused step's arrays live: global arrays on a 1-D "data" mesh, built from this process's
pieces, and this process's part of them read back.

A value is either replicated (the same on every device: parameters, optimizer state, buffers) or
split (its rows divided over the devices in mesh order: the batch, `ShardedEmbedding` rows). The
processes' devices must be contiguous along the axis (how `make_mesh({"data": -1})` lays it out),
so that this process's rows are one contiguous block of the global array.

Also here: a compiled module's staged inputs on the device its call computes on (`InputStaging`),
and `device_report`, which device each path computes on (what `tpudist doctor` prints).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist._buffers import HostBuffers, narrowed, torch_dtypes, torch_view
from tpudist._jaxcompat import assemble, import_buffer
from tpudist.compile._torch._convert import compute_device, to_jax, viewable

AXIS = "data"
# a sharded step splits the batch over whichever of these its mesh has (with pipeline stages, each
# process passes its own rows, and the step hands every micro-batch to the first stage)
BATCH_AXES = (AXIS, "fsdp", "stage")


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
        self.spmd = False  # per-device (shard_map) steps; see SpmdPlacement

    def param_split(self, entry: Any) -> bool:
        """How a layout entry's parameter and optimizer state are laid out (`put`'s `split`)."""
        return entry.sharded

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
        value = _host_array(value, copy)
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


class SpmdPlacement:
    """Global arrays of a mesh of any axes, for the sharded (global-view) fused step: the batch split
    over the mesh's batch axes ("data" and "fsdp", whichever it has), the parameters and optimizer
    state laid out by their `PartitionSpec`s (`specs`, by parameter id), the rest replicated.

    Each process passes its own rows of the global batch: the rows of the batch shards its devices
    hold, in order. Two processes may not hold the same batch shard (they would have to pass equal
    rows), so an axis that spans processes must be a batch axis."""

    spmd = True
    single = False

    def __init__(self, mesh: Any, specs: dict[int, P] | None = None):
        me = jax.process_index()
        self.mesh, self.specs = mesh, dict(specs or {})
        self.total = mesh.devices.size
        self.batch_axes = tuple(a for a in mesh.axis_names if a in BATCH_AXES)
        self.batch_spec = P(self.batch_axes) if self.batch_axes else P()
        self.replicated = NamedSharding(mesh, P())
        self.split = NamedSharding(mesh, self.batch_spec)
        self.batch_shards = int(np.prod([mesh.shape[a] for a in self.batch_axes], dtype=int))
        self.devices = [d for d in mesh.devices.flat if d.process_index == me]
        index = {d: (s[0].start or 0) for d, s in self.split.devices_indices_map((self.batch_shards,)).items()}
        owners: dict[int, set[int]] = {}
        for d, k in index.items():
            owners.setdefault(k, set()).add(d.process_index)
        shared = {k: sorted(ps) for k, ps in owners.items() if len(ps) > 1}
        if shared:
            k, ps = next(iter(shared.items()))
            raise ValueError(f"processes {ps} all hold batch shard {k} of mesh {dict(mesh.shape)}: the axes that span "
                             f"processes must split the batch; put a 'data' or 'fsdp' axis across processes and "
                             f"'model' inside them (tpudist.mesh.make_mesh({{'fsdp': -1, 'model': M}}))")
        mine = sorted({index[d] for d in self.devices})
        if mine != list(range(mine[0], mine[0] + len(mine))):
            raise ValueError(f"rank {me}: this process's batch shards {mine} are not contiguous; build the mesh "
                             "with tpudist.mesh.make_mesh, batch axes first")
        self._first, self._index = mine[0], index
        self.local_count = len(mine)  # this process's rows split into this many shards
        self.cpu = all(d.platform == "cpu" for d in self.devices)

    def param_split(self, entry: Any) -> P:
        return self.specs.get(id(entry.param), P())

    def put(self, value: Any, split: bool | P, copy: bool = False) -> jax.Array:
        """This process's `value` as a global array: its rows of the batch (`split=True`), the
        same on every device (False), or a full value laid out by a PartitionSpec (each device
        takes its own block; nothing else crosses)."""
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            return value
        value = _host_array(value, copy)
        if split is True:
            rows = value.shape[0] // self.local_count
            pieces = [value[(self._index[d] - self._first) * rows:][:rows] for d in self.devices]
            shape, sharding = (rows * self.batch_shards, *value.shape[1:]), self.split
        elif split is False or not tuple(split):
            pieces, shape, sharding = [value] * len(self.devices), tuple(value.shape), self.replicated
        else:
            return put_laid_out(value, NamedSharding(self.mesh, split), self.devices, copy)
        shards = [_on_device(piece, device, copy) for piece, device in zip(pieces, self.devices)]
        return assemble(shape, sharding, shards)

    def local_blocks(self, array: jax.Array, split: bool | P) -> list[jax.Array]:
        """The whole value of `array` on one of this process's devices (a gather over the mesh,
        collective: every process makes the same calls, for an array laid out by a PartitionSpec)."""
        if split is not False and split is not True and tuple(split):
            array = relaid(array.sharding.mesh)(array)
        return [array.addressable_shards[0].data]


def put_laid_out(value: Any, sharding: NamedSharding, devices: list[Any], copy: bool = False) -> jax.Array:
    """A full host `value` (the same on every process) as a global array laid out by `sharding`:
    each of this process's `devices` takes its own block; nothing else crosses."""
    value = _host_array(value, copy)
    shape = tuple(value.shape)
    blocks = sharding.addressable_devices_indices_map(shape)
    pieces = [_contiguous(value[blocks[d]]) for d in devices]
    return assemble(shape, sharding, [_on_device(piece, device, copy) for piece, device in zip(pieces, devices)])


@functools.lru_cache(maxsize=None)
def relaid(mesh: Any, spec: P = P()) -> Any:
    """A jitted identity that lays its argument out by `spec` over `mesh` (default: whole on every
    device, a gather); a collective where the mesh spans processes."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, spec))


def _host_array(value: Any, copy: bool) -> Any:
    """A torch tensor as it is; anything else as a C-ordered numpy array in JAX's dtype for it."""
    if isinstance(value, torch.Tensor):
        return value
    value = np.asarray(value)
    dtype = jax.dtypes.canonicalize_dtype(value.dtype)
    return np.array(value, dtype, order="C") if copy else np.ascontiguousarray(value, dtype=dtype)


def _contiguous(piece: Any) -> Any:
    if isinstance(piece, torch.Tensor):
        return piece.contiguous()
    return np.ascontiguousarray(piece)


def placement_for(mesh: Any) -> Placement | SpmdPlacement:
    """Where a fused step over `mesh` puts its batch: per device over a 1-D "data" mesh, else global."""
    return Placement(mesh) if tuple(mesh.axis_names) == (AXIS,) else SpmdPlacement(mesh)


STAGE_MAX_BYTES = 256 * 1024  # per process and leaf; larger inputs cross by import


class Staging:
    """Reused device buffers for a batch's small tensors, on a CPU mesh: each step copies its
    values in (one memcpy, any int64 narrowed on the way) instead of importing fresh buffers.

    An imported buffer costs more than its import: the executable waits for the new buffer's
    definition on the device's queue (tens of microseconds, the whole step of a small model).
    `sets` sets (`HostBuffers`) take turns, and before one is written again the host waits for the
    step `QUEUED` steps back rather than the set's own reader, so it sleeps once every
    `sets - QUEUED + 1` steps while the device keeps the newest step queued (the transformer block's
    CPU per staged step: ~500 us -> ~200 us; history in docs/bench/HISTORY.md)."""

    QUEUED = 2

    def __init__(self, placement: Placement, examples: list[torch.Tensor], sets: int = 2):
        self.placement = placement
        like = [(tuple(t.shape), jax.dtypes.canonicalize_dtype(_np_dtype(t.dtype))) for t in examples]
        self.sets: list[HostBuffers] = []
        for _ in range(sets):
            buffers = HostBuffers.build(like, lambda host: placement.put(host, split=True))
            if buffers is None:
                raise RuntimeError("staging buffer was copied, not shared, by the import")
            self.sets.append(buffers)
        # written through torch: one copy_ each
        self._tensors = [[torch_view(host) for host in buffers.hosts] for buffers in self.sets]
        self._next = 0

    @staticmethod
    def fits(placement: Placement, t: Any) -> bool:
        # not 0-d (a 0-d NumPy host array imports as shape (1,)) nor bfloat16 (NumPy's does not
        # cross DLPack): those cross by import
        return (placement.cpu and isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
                and t.numel() * t.element_size() <= STAGE_MAX_BYTES and t.dtype != torch.bfloat16
                and _np_dtype(t.dtype) is not None)

    def put(self, tensors: list[torch.Tensor]) -> tuple[list[jax.Array], int]:
        """The staged global arrays holding `tensors` now, and the set's index (for `used`)."""
        index, count = self._next, len(self.sets)
        self._next = (index + 1) % count
        buffers = self.sets[index]
        if buffers.busy():
            self.sets[(index - self.QUEUED) % count].wait()
            buffers.wait()  # ready by now where steps run in order
        for host, t in zip(self._tensors[index], tensors):
            host.copy_(t.detach() if t.requires_grad else t)  # int64 narrowed to int32 on the way
        return buffers.arrays, index

    def used(self, index: int, result: Any) -> None:
        """`result` is an output of the step that reads set `index`: wait for it before reuse."""
        self.sets[index].used(result)


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
        self.checked, self._aliased = False, False

    @classmethod
    def build(cls, tensors: list[torch.Tensor], slots: list[int], device: Any) -> InputStaging | None:
        """Staging on `device` for `tensors[i]` of every i in `slots` (shapes and dtypes as now), or
        None where one does not fit (too large, not on the CPU), `device` is not host memory torch
        views (a TPU: each call copies its inputs there) or this platform would copy on import."""
        if not slots or not viewable(device):
            return None
        placement = _one_device_placement(device)
        if not all(Staging.fits(placement, tensors[i]) for i in slots):
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
            buffers.holds(o) for buffers in self._staging.sets) for o in outputs)


@functools.lru_cache(maxsize=64)
def _one_device_placement(device: Any) -> Placement:
    """A placement on `device` alone (a compiled module's staged inputs)."""
    from jax.sharding import Mesh
    return Placement(Mesh(np.array([device]), (AXIS,)))


def _np_dtype(dtype: torch.dtype) -> Any:
    """The dtype JAX computes torch's `dtype` in, or None where none crosses."""
    found = torch_dtypes().get(dtype)
    return None if found is None else narrowed(found)


def _on_device(piece: Any, device: Any, copy: bool = False) -> jax.Array:
    if isinstance(piece, torch.Tensor):
        return to_jax(piece, copy=copy, device=device)
    array = import_buffer(piece, device) if device.platform == "cpu" else None
    return array if array is not None else jax.device_put(piece, device)


def device_report() -> list[tuple[str, str]]:
    """(path, the device it computes on and why) for each path of this process: the compiled module
    and the dynamo backend (`compute_device`), the fused step's default mesh, the collectives.
    What `tpudist doctor` prints."""
    module = compute_device()
    chosen = jax.config.jax_default_device
    why = f"jax_default_device={chosen}" if chosen is not None else f"none set: first {jax.default_backend()} device"
    crossing = ("torch's CPU tensors viewed in place" if viewable(module) else
                "torch's CPU tensors copied there, parameters kept resident, results copied back")
    devices, local = jax.devices(), jax.local_devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    shown = ", ".join(str(d) for d in devices[:4]) + (" ..." if len(devices) > 4 else "")
    return [
        ("tpudist.compile(module)", f"{module}: JAX's default device, read at each call ({why}); {crossing}; "
                                    "CUDA tensors stay on their GPU"),
        ("torch.compile(backend='tpudist')", f"{module}: as tpudist.compile(module)"),
        ("fused step, default mesh", f"{len(devices)} device(s) of every process ({kinds}): {shown}"),
        ("collectives", f"{local[0]}: this process's first device"),
    ]
