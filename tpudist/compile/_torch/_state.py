"""The fused step's state on the devices, and the torch objects' view of it, kept in step on demand.

Between steps the parameters, the optimizer state, each parameter's step count and the buffers
the graph updates (BatchNorm statistics) are device arrays, fed from one step's outputs to the
next: no step copies anything to the host. torch's objects (`p.data`, `optimizer.state`, module
buffers) are brought up to date only when they are read through a door:

- `model.state_dict()`, `optimizer.state_dict()` (pre-hooks), an eager call of the model or of
  any of its submodules (forward pre-hooks), `tpudist.compile(model)` calls, `step.sync()`;
- `model.load_state_dict()` / `optimizer.load_state_dict()` first sync, then make the torch
  values the truth: the next step uploads them.

After a sync, torch may change what it now holds (`with torch.no_grad(): p.add_(1)`, a new
optimizer state tensor, an eager forward updating BatchNorm statistics); the first step after a
sync compares every tensor's identity and version counter with what the sync wrote and uploads
what changed. Steps in between do no per-parameter work at all. Reading a parameter without a
door (`p.data` right after a step) sees the values of the last sync.

Crossing to the host is `to_host` (counted in `crossings`): a zero-copy view where torch can see
the device's memory (CPU), else one device-to-host copy; `TPUDIST_TORCH_HOST_VIEW=0` (or
`HOST_VIEW = False`) forces the copy on CPU too, as on a TPU.
"""

from __future__ import annotations

import collections
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from tpudist import contract
from tpudist.compile._torch import _optim
from tpudist.compile._torch._convert import torch_view
from tpudist.compile._torch._pool import StatePool

if TYPE_CHECKING:
    from tpudist.compile._torch._placement import Placement
    from tpudist.compile._torch._plan import Layout

# None: decided per array (torch views CPU buffers); False: always copy, as on a TPU
HOST_VIEW: bool | None = None if os.environ.get(contract.TORCH_HOST_VIEW, "1") != "0" else False
crossings: collections.Counter = collections.Counter()  # "to_host", "to_device": arrays crossed

# every mirror of a module, so that any of them (or a compiled module) can bring torch up to date
_MIRRORS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def to_host(array: jax.Array) -> Any:
    """One single-device array's value for torch: a zero-copy torch view where torch can see the
    memory, else a numpy copy (one device-to-host transfer)."""
    crossings["to_host"] += 1
    if HOST_VIEW is not False and next(iter(array.devices())).platform == "cpu":
        return torch_view(array)
    return np.asarray(jax.device_get(array))


def sync_module(module: torch.nn.Module) -> None:
    """Brings `module`'s parameters and buffers (and the optimizers of fused steps training it) up
    to date with every fused step that trains it."""
    for mirror in list(_MIRRORS.get(module, ())):
        mirror.sync()


class Mirror:
    """One fused step's device state and its torch counterpart (see the module docstring).

    params, states, counts: per layout entry, the parameter, its optimizer-state arrays, and all
    step counts as one float32 array; named: the other state the graphs read, by key (buffers and
    frozen parameters by path). `owner` is the compiled signature whose updated-buffer list holds
    the newest buffer values (it keeps them in its own lists between its steps).
    On one device the parameters and optimizer state travel as a pool (`pool`, see `_pool`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: "Layout",
                 placement: "Placement"):
        self.model, self.optimizer, self.layout, self.placement = model, optimizer, layout, placement
        self.pool = StatePool(layout, pooled=placement.single and not any(e.sharded for e in layout.entries))
        self.counts: jax.Array | None = None
        self.named: dict[str, jax.Array] = {}
        self.named_sources: dict[str, Any] = {}  # key -> getter of its torch tensor
        self.updated_keys: set[str] = set()  # named state some graph writes back (BatchNorm statistics)
        self.owner: Any = None
        self.generation = 0  # bumped whenever `named` changes: signatures rebuild their lists then
        self.device_current: bool | None = None  # the device arrays hold the newest values (None: none yet)
        self.torch_current = True    # torch's objects hold the newest values
        self.reloads = 0
        self._written: dict[str, tuple[int, int, int]] = {}  # key -> (id, data_ptr, version) when equal
        self._synced_counts: list[float] = []
        self._hooks = _install_hooks(self, model, optimizer)
        for module in model.modules():  # a submodule read on its own is a door too
            _MIRRORS.setdefault(module, weakref.WeakSet()).add(self)
        self._peers = _MIRRORS[model]  # every mirror of this model, this one included

    params = property(lambda self: self.pool.entries()[0], doc="Per layout entry, its parameter's array.")
    states = property(lambda self: self.pool.entries()[1], doc="Per layout entry, its optimizer-state arrays.")

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- before a step -----------------------------------------------------------------------------

    def register(self, fixed: list[tuple[str, Any]], updated: list[tuple[str, Any]]) -> None:
        """The state keys a new graph reads (uploaded now if the device state exists already)."""
        for key, get in fixed + updated:
            if key not in self.named_sources:
                self.named_sources[key] = get
                if self.device_current:
                    self.flush_owner()
                    self.named[key] = self._put(get(), False)
                    self._record(key, get())
                    self.generation += 1
        self.updated_keys.update(key for key, _ in updated)

    @property
    def shared(self) -> bool:
        """Whether other fused steps train the same model (then each step checks them first)."""
        return len(self._peers) > 1

    def prepare(self) -> None:
        """Makes the device arrays current before a step: uploads what torch changed (nothing,
        and no per-parameter work, between two steps)."""
        if self.shared:
            for other in list(self._peers):
                if other is not self and not other.torch_current:
                    other.sync()  # another step trained this model since: its values first
                    self.torch_current = True
        if not self.device_current:
            self._upload_all()
        elif self.torch_current:
            self._upload_changed()

    def _upload_all(self) -> None:
        from tpudist import _profile
        with _profile.span("tpudist.torch_upload", arrays=len(self.layout)):
            self._upload_all_now()

    def _upload_all_now(self) -> None:
        self.flush_owner()
        put = self._put
        optimizer_state = self.optimizer.state
        params, states, counts = [], [], []
        for entry in self.layout.entries:
            p, cfg = entry.param, entry.config
            state = optimizer_state.get(p, {})
            params.append(put(p, entry.sharded))
            initial = None
            values = []
            for field in cfg.state:
                current = state.get(field)
                if current is None:
                    initial = initial or _optim.initial_state(cfg, p)
                    current = initial[len(values)]
                values.append(put(current, entry.sharded))
            states.append(tuple(values))
            counts.append(_optim.step_count(cfg, state))
        self.pool.set(params, states)
        self.counts = put(np.asarray(counts, np.float32), False)
        self.named = {key: put(get(), False) for key, get in self.named_sources.items()}
        self.owner = None
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
                params[i] = self._put(p, entry.sharded)
                changed = True
            state = optimizer_state.get(p, {})
            values = list(states[i])
            for j, field in enumerate(cfg.state):
                current = state.get(field)
                if current is not None and self._moved(f"state {i} {field}", current):
                    values[j] = self._put(current, entry.sharded)
                    changed = True
            states[i] = tuple(values)
        if changed:
            self.pool.set(params, states)
        counts = [_optim.step_count(e.config, optimizer_state.get(e.param, {})) for e in self.layout.entries]
        if counts != self._synced_counts:
            self.counts = self._put(np.asarray(counts, np.float32), False)
            changed = True
        self.flush_owner()
        for key, get in self.named_sources.items():
            if key not in self.named or self._moved(key, get()):
                self.named[key] = self._put(get(), False)
                self.generation += 1
                changed = True
        self.reloads += changed
        self._remember_torch(counts)

    def _moved(self, key: str, tensor: torch.Tensor) -> bool:
        return self._written.get(key) != (id(tensor), tensor.data_ptr(), tensor._version)

    def _put(self, value: Any, split: bool) -> jax.Array:
        crossings["to_device"] += 1
        if isinstance(value, torch.Tensor):
            value = value.detach()
        return self.placement.put(value, split)

    def flush_owner(self) -> None:
        """Moves the newest buffer values out of the signature that holds them."""
        if self.owner is not None:
            for (key, _), array in zip(self.owner.plan.updated, self.owner.updated):
                self.named[key] = array
            self.owner = None
            self.generation += 1

    # -- after a step ---------------------------------------------------------------------------

    def stepped(self, params: Any, states: Any, counts: jax.Array, owner: Any) -> None:
        """A step's new state, in the form `pool.step_arrays()` gave it."""
        self.pool.stepped(params, states)
        self.counts, self.owner, self.torch_current = counts, owner, False

    # -- torch's view ----------------------------------------------------------------------------

    def sync(self) -> None:
        """Writes the device values into the model's parameters and buffers and the optimizer's
        state (one crossing per array; nothing to do when torch is already current)."""
        if self.torch_current or not self.device_current:
            return  # torch holds the newest values already
        from tpudist import _profile
        with _profile.span("tpudist.torch_sync", arrays=len(self.layout)):
            self._sync()

    def _sync(self) -> None:
        self.flush_owner()
        counts = np.asarray(self._host(self.counts, False), dtype=np.float32).reshape(-1)
        optimizer_state = self.optimizer.state
        with torch.no_grad():
            for i, entry in enumerate(self.layout.entries):
                p, cfg = entry.param, entry.config
                _write(p.data, self._host(self.params[i], entry.sharded))
                if not cfg.state or (cfg.kind == "sgd" and counts[i] == 0):
                    continue  # torch keeps no state for it (yet)
                state = optimizer_state[p]
                for field, array in zip(cfg.state, self.states[i]):
                    value = self._host(array, entry.sharded)
                    if isinstance(state.get(field), torch.Tensor) and state[field].shape == p.shape:
                        _write(state[field], value)
                    else:
                        state[field] = _fresh(value, p.dtype)
                if cfg.kind == "adam":
                    state["step"] = torch.tensor(float(counts[i]), dtype=torch.float32)
            for key in self.updated_keys:  # the rest of `named` is what torch uploaded, unchanged
                _write(self.named_sources[key](), self._host(self.named[key], False))
        self._remember_torch([float(c) for c in counts])
        self.torch_current = True

    def _host(self, array: jax.Array, split: bool) -> Any:
        return _host_value(self.placement, array, split)

    def _record(self, key: str, tensor: torch.Tensor) -> None:
        self._written[key] = (id(tensor), tensor.data_ptr(), tensor._version)

    # -- checkpoints ------------------------------------------------------------------------------

    def state_tree(self) -> dict[str, Any]:
        """The training state as it is on the devices (for `tpudist.checkpoint.save`): parameters,
        optimizer state and step counts per layout entry, and the model's buffers (the newest
        values: the device's for those a graph updates, torch's for the rest). Needs the device
        state (`prepare()` first)."""
        self.flush_owner()
        buffers = {}
        for name, buffer in self.model.named_buffers():
            key = f"model.{name}"
            buffers[name] = self.named[key] if key in self.named and key in self.updated_keys \
                else self._put(buffer, False)
        return {"params": list(self.params), "optimizer": [list(s) for s in self.states], "counts": self.counts,
                "buffers": buffers}

    def load_tree(self, tree: dict[str, Any]) -> None:
        """Makes `tree` (from `state_tree`, restored with its shardings) the training state: the
        device arrays directly, the buffers through torch (small; uploaded by the next step)."""
        self.flush_owner()
        self.pool.set(list(tree["params"]), [tuple(s) for s in tree["optimizer"]])
        self.counts = tree["counts"]
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name in tree["buffers"]:
                    _write(buffer, self._host(tree["buffers"][name], False))
        for key in list(self.named):  # buffers the graphs read: re-read from torch
            if key.startswith("model."):
                self.named[key] = self._put(self.named_sources[key](), False)
        self.generation += 1
        self.device_current = True
        self.torch_current = False  # torch's parameters and optimizer state: at the next door

    def torch_changed(self) -> None:
        """torch's objects were loaded from elsewhere: they are the truth for the next step."""
        self.device_current = False
        self.torch_current = True


def _host_value(placement: "Placement", array: jax.Array, split: bool) -> Any:
    """This process's part of `array` for torch (one crossing per local block)."""
    blocks = [to_host(b) for b in placement.local_blocks(array, split)]
    if len(blocks) == 1:
        return blocks[0]
    return torch.cat([torch.as_tensor(b) for b in blocks])


def _as_torch(value: Any) -> torch.Tensor:
    """A host value as a torch tensor, only ever read (copied from)."""
    if isinstance(value, torch.Tensor):
        return value
    value = np.asarray(value)
    with warnings.catch_warnings():  # a device_get result is read-only; torch warns, we only read it
        warnings.simplefilter("ignore", UserWarning)
        if value.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: reinterpret the bits
            return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(value)


def _write(target: torch.Tensor, value: Any) -> None:
    target.copy_(_as_torch(value).reshape(target.shape))


def _fresh(value: Any, dtype: torch.dtype) -> torch.Tensor:
    return _as_torch(value).to(dtype).clone()


def _install_hooks(mirror: Mirror, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The doors: hooks that sync before torch reads the state and hand the truth to torch after it
    loads new state. They hold the mirror weakly (a dropped step leaves only inert hooks)."""
    ref = weakref.ref(mirror)

    def sync(*_: Any, **__: Any) -> None:
        target = ref()
        if target is not None and not _exporting():
            target.sync()

    def loaded(*_: Any, **__: Any) -> None:
        target = ref()
        if target is not None:
            target.torch_changed()

    handles = [optimizer.register_state_dict_pre_hook(sync),
               optimizer.register_load_state_dict_pre_hook(sync),
               optimizer.register_load_state_dict_post_hook(loaded)]
    for module in model.modules():  # any submodule's state_dict, load_state_dict or forward
        handles += [module.register_state_dict_pre_hook(sync), module.register_load_state_dict_pre_hook(sync),
                    module.register_load_state_dict_post_hook(loaded), module.register_forward_pre_hook(sync)]
    return handles


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())
