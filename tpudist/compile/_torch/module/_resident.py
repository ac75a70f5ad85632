"""Tensors a compiled graph writes in place (a static KV cache, BatchNorm's running statistics):
kept on the device between calls, and written back into torch by what changed.

A graph input that the forward modifies in place comes back as a new array. Torch must see the new
values (it owns the tensor), but crossing the whole tensor both ways on every call costs what the
tensor weighs: for a static KV cache, the whole cache per generated token. So

- the new array stays on the device as the tensor's resident value (`Resident`): the next call
  takes it instead of the tensor, as long as torch has not changed the tensor since (the tensor's
  identity, data pointer and version counter say so; torch's own write-back below is counted);
- a write that is a scatter into the input (`aten.index_put(x, indices, values)`: what
  `index_copy_` and `x[:, :, positions] = v` become, how Hugging Face's `StaticCache.update` writes
  a token) crosses back as its indices and values only, applied to torch's tensor with `index_put_`
  (`scatter_outputs` adds them to the graph's outputs); any other write crosses whole.

Torch's tensor is therefore always current: nothing reads it stale, and no door is needed.

Where torch cannot view the device, an output crosses to the host as a copy; `Twins` keeps the
device array it came from, which a later call that writes the tensor in place takes instead of
uploading it (the static cache a prefill creates, written by the decode step or loop).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import jax
import torch

from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch.lowering._captured import Captured, OutputSlot, Slot

_INDEX_PUT = torch.ops.aten.index_put.default


@dataclass(frozen=True)
class Scatter:
    """A write-back output that is a scatter: outputs `values` and `indices` (positions among the
    graph's outputs; None for a full slice, as in `x[:, :, idx]`) rebuild it on torch's tensor."""

    output: int
    indices: tuple[int | None, ...]
    values: int


def scatter_outputs(captured: Captured) -> dict[int, Scatter]:
    """Adds the indices and values of each scatter write-back to `captured`'s outputs (as
    `Slot.PIECE` outputs); returns them by the write-back's output position."""
    nodes = list(captured.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    slots = dict(zip(placeholders, captured.inputs))
    output = next(n for n in nodes if n.op == "output")
    values = list(output.args[0])
    found: dict[int, Scatter] = {}
    for position, (value, slot) in enumerate(zip(values, captured.outputs)):
        if slot.kind not in (Slot.INPUT, Slot.BUFFER) or not isinstance(value, torch.fx.Node):
            continue
        if value.target is not _INDEX_PUT or len(value.args) > 3 and value.args[3]:
            continue
        base, indices, update = value.args[:3]
        written = slots.get(base)
        if written is None or not written.mutated or not _writes(written, slot):
            continue
        if not all(i is None or isinstance(i, torch.fx.Node) for i in indices):
            continue
        positions = []
        for index in indices:
            if index is None:
                positions.append(None)
            else:
                positions.append(len(values))
                values.append(index)
                captured.outputs.append(OutputSlot(Slot.PIECE, None, index.meta["val"].dtype))
        found[position] = Scatter(position, tuple(positions), len(values))
        values.append(update)
        captured.outputs.append(OutputSlot(Slot.PIECE, None, update.meta["val"].dtype))
    if found:
        output.args = (type(output.args[0])(values), *output.args[1:])
        captured.graph.lint()
    return found


def _writes(written: Any, slot: OutputSlot) -> bool:
    """Whether the write-back `slot` targets the input `written`."""
    if slot.kind is Slot.BUFFER:
        return written.kind is Slot.BUFFER and written.name == slot.target
    return written.kind is Slot.INPUT and written.leaf == slot.target


class Resident:
    """The device arrays of the tensors a program writes, by input position, valid while torch has
    not changed the tensor (see the module docstring)."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[Any, int, int, Any, jax.Array]] = {}

    def get(self, position: int, tensor: torch.Tensor, where: Any) -> jax.Array | None:
        kept = self._arrays.get(position)
        if kept is None:
            return None
        ref, version, pointer, place, array = kept
        if ref() is not tensor or tensor._version != version or tensor.data_ptr() != pointer or place != where \
                or array.is_deleted():
            del self._arrays[position]
            return None
        return array

    def keep(self, position: int, tensor: torch.Tensor, where: Any, array: jax.Array) -> None:
        self._arrays[position] = (weakref.ref(tensor), tensor._version, tensor.data_ptr(), where, array)

    def drop(self, position: int) -> None:
        self._arrays.pop(position, None)

    def arrays(self) -> list[jax.Array]:
        """The arrays kept now (whose tensors are alive)."""
        return [kept[4] for kept in self._arrays.values() if kept[0]() is not None and not kept[4].is_deleted()]


def write_scatter(tensor: torch.Tensor, scatter: Scatter, outputs: list[Any]) -> None:
    """Applies one scatter write-back to torch's `tensor` from the crossed pieces in `outputs`."""
    # aten.index_put's None index is a whole dimension: x[:, :, idx] = v
    where = tuple(slice(None) if i is None else outputs[i] for i in scatter.indices)
    with torch.no_grad():
        tensor[where] = outputs[scatter.values].to(tensor.dtype)


class Twins:
    """The device arrays of the tensors torch got from a call's outputs where torch cannot view the
    device (a TPU): each output crossed to the host as a copy, and the array it came from is still
    on the device. A later call that writes such a tensor in place (the static cache a prefill
    created, taken by the decode step or the decode loop) takes the array instead of uploading the
    tensor again, while torch has not changed the tensor since (identity, data pointer, version).

    Only the last call of each program keeps its twins (a new call of the program replaces them),
    so the device holds at most one call's outputs twice; a twin taken is the taker's (donated)."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[Any, int, int, Any, jax.Array, int]] = {}  # id(tensor) -> entry, owner last

    def replace(self, owner: int, outputs: list[Any], arrays: list[Any], slots: list[OutputSlot],
                device: Any) -> None:
        """`owner`'s last call: the twins of its user outputs (torch's `outputs`, from `arrays` on
        `device`) instead of its call before's: each CPU tensor whose array is a JAX array of the
        dtype `to_jax` makes of it."""
        for key in [key for key, entry in self._arrays.items() if entry[5] == owner]:
            del self._arrays[key]
        kept = [(tensor, array) for tensor, array, slot in zip(outputs, arrays, slots)
                if slot.kind == Slot.USER and isinstance(tensor, torch.Tensor) and isinstance(array, jax.Array)
                and tensor.device.type == "cpu" and jax_dtype(tensor.dtype) == array.dtype]
        for tensor, array in kept:
            ref = weakref.ref(tensor, functools.partial(self._gone, id(tensor)))  # a dead tensor's twin goes too
            self._arrays[id(tensor)] = (ref, tensor._version, tensor.data_ptr(), device, array, owner)

    def _gone(self, key: int, ref: Any) -> None:
        entry = self._arrays.get(key)
        if entry is not None and entry[0] is ref:
            del self._arrays[key]

    def take(self, tensor: torch.Tensor, device: Any) -> jax.Array | None:
        """The array `tensor` was copied from, handed over (no longer kept), or None."""
        entry = self._arrays.get(id(tensor))
        if entry is None:
            return None
        del self._arrays[id(tensor)]
        ref, version, pointer, place, array, _ = entry
        if ref() is not tensor or tensor._version != version or tensor.data_ptr() != pointer or place != device \
                or array.is_deleted():
            return None
        return array


TWINS = Twins()


def written_array(resident: Resident, position: int, tensor: torch.Tensor, device: Any,
                  host: bool) -> jax.Array | None:
    """The array a program takes for the input it writes at `position`: its own from its last call,
    else (`host`: torch cannot view the device) the twin of an earlier call's output; None: upload it."""
    kept = resident.get(position, tensor, device)
    return kept if kept is not None or not host else TWINS.take(tensor, device)
