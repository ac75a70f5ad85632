"""`TrainStep.memory()`: the bytes the fused step holds on each device, and XLA's estimate of its peak.

Memory is what limits the model a step can train, so the step reports it from what it actually
holds between steps: the arrays the next step takes. Bytes are counted per device from each
array's `addressable_shards` (this process's devices), so a sharded array counts the rows each
device holds, never its global shape times the device count. On one device the parameters and
optimizer state are packed into a pool of one buffer per dtype (`_pool`): a pool buffer's bytes
are split between parameters and optimizer state by its members' sizes in the pool's layout
(`_pack.Packing`). Batch buffers, the random key and the hyperparameter table are not counted
(a few KiB besides the batch, which `executable.argument` includes).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from tpudist.compile._torch.train._device import DeviceState

NOT_YET = "call the step once first: memory is known after the first compile"


@dataclass(frozen=True)
class ExecutableMemory:
    """XLA's estimate for one device's part of the compiled step (`Compiled.memory_analysis()`), in bytes."""

    argument: int   # the step's inputs: state, batch, key
    output: int     # its outputs: the new state, the loss
    temp: int       # intermediates: activations, gradients
    alias: int      # outputs written into a donated input's buffer (counted in both above)
    code: int       # generated code

    @property
    def peak(self) -> int:
        """argument + output + temp - alias: everything live while the step runs, a donated
        buffer counted once."""
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def of(cls, compiled: Any) -> ExecutableMemory | None:
        """`compiled`'s estimate, or None where the backend reports none."""
        try:
            stats = compiled.memory_analysis()
        except (NotImplementedError, RuntimeError):  # jaxlib's XlaRuntimeError is a RuntimeError
            return None
        if stats is None:
            return None
        return cls(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                   int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes),
                   int(stats.generated_code_size_in_bytes))


@dataclass(frozen=True)
class StepMemory:
    """What a fused train step holds, in bytes per device (keyed by device id, this process's devices).

    parameters: the parameters the step trains or reads; optimizer: their optimizer state (momentum
    buffers, Adam's moments) and step counts; buffers: the other state the graphs read (BatchNorm
    statistics, lifted constants); executable: XLA's estimate for the current signature's
    executable (None: not reported by this backend). Example (`print(step.memory())`, a
    64-256-10 MLP with BatchNorm and AdamW on one CPU device):

        fused step memory per device
        device     parameters    optimizer      buffers        total
        0            77.0 KiB    154.1 KiB      2.0 KiB    233.1 KiB
        XLA's estimate of the step's peak per device: 426.4 KiB
          = arguments 241.3 KiB + outputs 233.2 KiB + temp 185.0 KiB - aliased 233.1 KiB (code 0 B)
    """

    parameters: dict[int, int]
    optimizer: dict[int, int]
    buffers: dict[int, int]
    executable: ExecutableMemory | None

    @property
    def per_device(self) -> dict[int, int]:
        """The state's bytes on each device (parameters + optimizer + buffers)."""
        devices = sorted(set(self.parameters) | set(self.optimizer) | set(self.buffers))
        return {d: self.parameters.get(d, 0) + self.optimizer.get(d, 0) + self.buffers.get(d, 0) for d in devices}

    @property
    def max(self) -> int:
        """The most state bytes on any one device: what must fit."""
        return max(self.per_device.values(), default=0)

    @property
    def total(self) -> int:
        """The state's bytes over this process's devices together."""
        return sum(self.per_device.values())

    def __str__(self) -> str:
        rows = ["fused step memory per device", f"{'device':<8}" + "".join(
            f"{h:>13}" for h in ("parameters", "optimizer", "buffers", "total"))]
        for d, total in self.per_device.items():
            values = (self.parameters.get(d, 0), self.optimizer.get(d, 0), self.buffers.get(d, 0), total)
            rows.append(f"{d:<8}" + "".join(f"{_human(v):>13}" for v in values))
        x = self.executable
        if x is None:
            rows.append("XLA's estimate of the step's peak: not reported by this backend")
        else:
            rows += [f"XLA's estimate of the step's peak per device: {_human(x.peak)}",
                     f"  = arguments {_human(x.argument)} + outputs {_human(x.output)} + temp {_human(x.temp)}"
                     f" - aliased {_human(x.alias)} (code {_human(x.code)})"]
        return "\n".join(rows)


def step_memory(state: DeviceState, executable: Any) -> StepMemory:
    """`StepMemory` of the device state `state` and the compiled step `executable` (a
    `jax.stages.Compiled`, None before the first step: RuntimeError)."""
    if executable is None or state.device_current is None:
        raise RuntimeError(NOT_YET)
    seen: set[int] = set()  # an array held twice (by the state and a signature) counts once
    arrays, packing = state.pool.held()
    trained = len(state.layout)
    parameters: collections.Counter = collections.Counter()
    optimizer: collections.Counter = collections.Counter()
    if packing is None:  # the flat per-entry arrays: every parameter, then every optimizer state
        for i, array in enumerate(arrays):
            _add(parameters if i < trained else optimizer, [array], seen)
    else:
        for members, buffer in zip(packing.groups, arrays):
            sizes = [math.prod(packing.shapes[i]) * packing.dtypes[i].itemsize for i in members]
            share = sum(s for i, s in zip(members, sizes) if i < trained) / max(sum(sizes), 1)
            for device, nbytes in _per_device([buffer], seen).items():
                parameters[device] += round(nbytes * share)
                optimizer[device] += nbytes - round(nbytes * share)
        for i, array in zip(packing.alone, arrays[len(packing.groups):]):
            _add(parameters if i < trained else optimizer, [array], seen)
    if state.counts is not None:
        _add(optimizer, [state.counts], seen)
    named = dict(state.named)
    if state.holder is not None:  # the newest buffer values (the named ones were donated to it)
        named.update(zip(state.holder.updated_keys, state.holder.updated))
    model_parameters = {f"model.{name}" for name, _ in state.model.named_parameters(remove_duplicate=False)}
    buffers: collections.Counter = collections.Counter()
    for key, array in named.items():
        _add(parameters if key in model_parameters else buffers, [array], seen)
    return StepMemory(dict(parameters), dict(optimizer), dict(buffers), ExecutableMemory.of(executable))


def _add(counter: collections.Counter, arrays: Iterable[jax.Array], seen: set[int]) -> None:
    counter.update(_per_device(arrays, seen))


def _per_device(arrays: Iterable[jax.Array], seen: set[int]) -> dict[int, int]:
    """Bytes of each live array's shards on this process's devices, by device id."""
    out: collections.Counter = collections.Counter()
    for array in arrays:
        if array is None or id(array) in seen or array.is_deleted():
            continue
        seen.add(id(array))
        for shard in array.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return dict(out)


def _human(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    exponent = min(int(math.log(nbytes, 1024)), 3)
    return f"{nbytes / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"
