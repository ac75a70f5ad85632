"""The fused step's state as device arrays, fed from one step to the next, and its uploads from torch.

Between steps the parameters, the optimizer state, each parameter's step count and the buffers
the graph updates (BatchNorm statistics) are device arrays: no step copies anything to the host.
They are uploaded from torch's objects once, then again only for what torch changed: every upload
and every sync (`_state.Mirror`) records each tensor's identity and version counter, and the first
step after a door compares them, so steps in between do no per-parameter work at all.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import jax
import numpy as np
import torch

from tpudist.compile._torch.train import _optim
from tpudist.compile._torch.train._plan import StateRead
from tpudist.compile._torch.train._pool import StatePool

if TYPE_CHECKING:
    from tpudist.compile._torch._placement import Placement
    from tpudist.compile._torch.train._plan import Layout

crossings: collections.Counter = collections.Counter()  # "to_host", "to_device": arrays crossed


class BufferHolder(Protocol):
    """What the state reads of the compiled signature that ran last: it keeps the newest values of
    the buffers its graph writes back in its own list between its steps (no per-step dict work)."""

    @property
    def updated_keys(self) -> Sequence[str]: ...

    @property
    def updated(self) -> Sequence[jax.Array]: ...


class DeviceState:
    """One fused step's device arrays (see the module docstring).

    params, states, counts: per layout entry, the parameter, its optimizer-state arrays, and all
    step counts as one float32 array; named: the other state the graphs read, by key (buffers and
    frozen parameters by path). `holder` is the signature whose updated-buffer list holds the
    newest buffer values. On one device the parameters and optimizer state travel as a pool
    (`pool`, see `_pool`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: "Layout",
                 placement: "Placement"):
        self.model, self.optimizer, self.layout, self.placement = model, optimizer, layout, placement
        self.pool = StatePool(layout, pooled=placement.single and not any(e.sharded for e in layout.entries))
        self.counts: jax.Array | None = None
        self.named: dict[str, jax.Array] = {}
        self.named_sources: dict[str, Callable[[], torch.Tensor]] = {}  # key -> getter of its torch tensor
        self.updated_keys: set[str] = set()  # named state some graph writes back (BatchNorm statistics)
        self.holder: BufferHolder | None = None
        self.generation = 0  # bumped whenever `named` changes: signatures rebuild their lists then
        self.device_current: bool | None = None  # the device arrays hold the newest values (None: none yet)
        self.torch_current = True    # torch's objects hold the newest values
        self.reloads = 0
        self._written: dict[str, tuple[int, int, int]] = {}  # key -> (id, data_ptr, version) when equal
        self._synced_counts: list[float] = []
        self.preloaded: dict[int, jax.Array] = {}  # parameters placed before the first upload (_meta)

    params = property(lambda self: self.pool.entries().params, doc="Per layout entry, its parameter's array.")
    states = property(lambda self: self.pool.entries().states, doc="Per layout entry, its optimizer-state arrays.")

    def register(self, fixed: list[StateRead], updated: list[StateRead]) -> None:
        """The state keys a new graph reads (uploaded now if the device state exists already)."""
        for key, get in fixed + updated:
            if key not in self.named_sources:
                self.named_sources[key] = get
                if self.device_current:
                    self.flush_holder()
                    self.named[key] = self._put(get(), False)
                    self._record(key, get())
                    self.generation += 1
        self.updated_keys.update(key for key, _ in updated)

    def flush_holder(self) -> None:
        """Moves the newest buffer values out of the signature that holds them."""
        if self.holder is not None:
            for key, array in zip(self.holder.updated_keys, self.holder.updated):
                self.named[key] = array
            self.holder = None
            self.generation += 1

    def stepped(self, params: list[jax.Array], states: list[tuple[jax.Array, ...]], counts: jax.Array,
                holder: BufferHolder) -> None:
        """A step's new state, in the form `pool.step_arrays()` gave it; `holder` keeps the buffers."""
        self.pool.stepped(params, states)
        self.counts, self.holder, self.torch_current = counts, holder, False

    # -- uploads from torch -------------------------------------------------------------------------

    def _upload_all(self) -> None:
        from tpudist import _profile
        with _profile.span("tpudist.torch_upload", arrays=len(self.layout)):
            self._upload_all_now()

    def _upload_all_now(self) -> None:
        self.flush_holder()
        put = self._put
        optimizer_state = self.optimizer.state
        params, states, counts = [], [], []
        for entry in self.layout.entries:
            p, cfg = entry.param, entry.config
            state = optimizer_state.get(p, {})
            preloaded = self.preloaded.pop(id(p), None)
            params.append(preloaded if preloaded is not None else put(p, self.placement.param_split(entry)))
            initial = None
            values = []
            for field in cfg.state:
                current = state.get(field)
                if current is None:
                    initial = initial or _optim.initial_state(cfg, p)
                    current = initial[len(values)]
                values.append(put(current, self.placement.param_split(entry)))
            states.append(tuple(values))
            counts.append(_optim.step_count(cfg, state))
        self.pool.set(params, states)
        self.counts = put(np.asarray(counts, np.float32), False)
        self.named = {key: put(get(), False) for key, get in self.named_sources.items()}
        self.holder = None
        self.generation += 1
        self.reloads += self.device_current is not None  # not the first upload
        self.device_current = True
        self._remember_torch(counts)

    def _remember_torch(self, counts: list[float]) -> None:
        """Records what torch holds now, equal to the device values (after an upload or a sync)."""
        optimizer_state = self.optimizer.state
        for i, entry in enumerate(self.layout.entries):
            self._record(f"param {i}", entry.param)
            state = optimizer_state.get(entry.param, {})
            for field in entry.config.state:
                if isinstance(state.get(field), torch.Tensor):
                    self._record(f"state {i} {field}", state[field])
        for key, get in self.named_sources.items():
            self._record(key, get())
        self._synced_counts = list(counts)

    def _upload_changed(self) -> None:
        changed = False
        optimizer_state = self.optimizer.state
        params, states = list(self.params), list(self.states)
        for i, entry in enumerate(self.layout.entries):
            p, cfg = entry.param, entry.config
            if self._moved(f"param {i}", p):
                params[i] = self._put(p, self.placement.param_split(entry))
                changed = True
            state = optimizer_state.get(p, {})
            values = list(states[i])
            for j, field in enumerate(cfg.state):
                current = state.get(field)
                if current is not None and self._moved(f"state {i} {field}", current):
                    values[j] = self._put(current, self.placement.param_split(entry))
                    changed = True
            states[i] = tuple(values)
        if changed:
            self.pool.set(params, states)
        counts = [_optim.step_count(e.config, optimizer_state.get(e.param, {})) for e in self.layout.entries]
        if counts != self._synced_counts:
            self.counts = self._put(np.asarray(counts, np.float32), False)
            changed = True
        self.flush_holder()
        for key, get in self.named_sources.items():
            if key not in self.named or self._moved(key, get()):
                self.named[key] = self._put(get(), False)
                self.generation += 1
                changed = True
        self.reloads += changed
        self._remember_torch(counts)

    def _moved(self, key: str, tensor: torch.Tensor) -> bool:
        return self._written.get(key) != (id(tensor), tensor.data_ptr(), tensor._version)

    def _record(self, key: str, tensor: torch.Tensor) -> None:
        self._written[key] = (id(tensor), tensor.data_ptr(), tensor._version)

    def _put(self, value: torch.Tensor | np.ndarray, split: bool) -> jax.Array:
        crossings["to_device"] += 1
        if isinstance(value, torch.Tensor):
            value = value.detach()
        return self.placement.put(value, split)
