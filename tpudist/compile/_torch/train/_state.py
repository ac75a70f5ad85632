"""The torch objects' view of the fused step's device state, kept in step on demand.

The state lives on the devices between steps (`_device.DeviceState`). torch's objects
(`p.data`, `optimizer.state`, module buffers) are brought up to date only when they are read
through a door:

- `model.state_dict()`, `optimizer.state_dict()` (pre-hooks), an eager call of the model or of
  any of its submodules (forward pre-hooks), `tpudist.compile(model)` calls, `step.sync()`;
- `model.load_state_dict()` / `optimizer.load_state_dict()` first sync, then make the torch
  values the truth: the next step uploads them.

Any other read of those tensors through torch is a door too: after a step they wear a stale
class (`_stale`) whose `__torch_function__` syncs first, so `p.data`, `p.clone()`,
`torch.allclose(p, q)` or `optimizer.state[p]["exp_avg"]` see the newest values. The classes go
on at the first step after a sync and come off at the sync.

After a sync, torch may change what it now holds (`with torch.no_grad(): p.add_(1)`, a new
optimizer state tensor, an eager forward updating BatchNorm statistics); the first step after a
sync uploads what changed.

Crossing to the host is `to_host` (counted in `crossings`): a zero-copy view where torch can see
the device's memory (CPU), else one device-to-host copy; `TPUDIST_TORCH_HOST_VIEW=0` (or
`HOST_VIEW = False`) forces the copy on CPU too, as on a TPU.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from tpudist import contract
from tpudist._buffers import torch_view
from tpudist.compile._torch.train import _optim
from tpudist.compile._torch import _stale
from tpudist.compile._torch import _sync
from tpudist.compile._torch.train._device import DeviceState, crossings
from tpudist.compile._torch._meta import hollow

if TYPE_CHECKING:
    from tpudist.compile._torch._placement import Placement
    from tpudist.compile._torch.train._plan import Layout

__all__ = ["HOST_VIEW", "Mirror", "crossings", "host_value", "to_host"]

HostValue = torch.Tensor | np.ndarray  # an array's value on the host: a torch view, or a numpy copy

# None: decided per array (torch views CPU buffers); False: always copy, as on a TPU
HOST_VIEW: bool | None = None if os.environ.get(contract.TORCH_HOST_VIEW, "1") != "0" else False


def to_host(array: jax.Array) -> HostValue:
    """One single-device array's value for torch: a zero-copy torch view where torch can see the
    memory, else a numpy copy (one device-to-host transfer)."""
    crossings["to_host"] += 1
    if HOST_VIEW is not False and next(iter(array.devices())).platform == "cpu":
        return torch_view(array)
    return np.asarray(jax.device_get(array))


class Mirror(DeviceState):
    """One fused step's device state (`DeviceState`) and its doors to torch (see the module
    docstring): hooks that sync before torch reads, and hand torch the truth after it loads."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: "Layout",
                 placement: "Placement"):
        super().__init__(model, optimizer, layout, placement)
        self._hooks = _install_hooks(self, model, optimizer)
        self._peers = _sync.register(model, self)  # every mirror of this model, this one included
        self._stale_classes = _stale.classes_for()
        self._marked: list[torch.Tensor] | None = None  # torch's tensors wearing a stale class now

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

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

    def start_from(self, arrays: dict[int, jax.Array]) -> None:
        """Starts from parameters already on the devices (by `id`; a meta-device model's, see
        `_meta`): their values live there only, so torch's doors read them from the devices."""
        self.preloaded = arrays
        self.prepare()
        self.torch_current = False
        self._mark()

    def stepped(self, params: list[jax.Array], states: list[tuple[jax.Array, ...]], counts: jax.Array,
                holder: Any) -> None:
        super().stepped(params, states, counts, holder)
        if self._marked is None:  # the first step since a sync: torch's tensors are stale from now on
            self._mark()

    # -- stale classes (see _stale) -----------------------------------------------------------------

    def _mark(self) -> None:
        """Marks torch's tensors of the state stale: the trained parameters, their optimizer state,
        the buffers a graph updates, and the optimizer's `state` dict; the first read syncs."""
        optimizer_state = self.optimizer.state
        tensors = []
        for entry in self.layout.entries:
            tensors.append(entry.param)
            tensors += [v for v in optimizer_state.get(entry.param, {}).values() if isinstance(v, torch.Tensor)]
        tensors += [self.named_sources[key]() for key in self.updated_keys]
        self._marked = _stale.mark(tensors, self._stale_classes, self)
        if getattr(self.optimizer.state, "_stale_owner", None) is not self:
            self.optimizer.state = _stale.StaleState(self, self.optimizer.state)

    def _unmark(self) -> None:
        if self._marked is None:
            return
        _stale.unmark(self._marked, self._stale_classes)
        self._marked = None
        state = self.optimizer.state
        if isinstance(state, _stale.StaleState) and state._stale_owner is self:
            self.optimizer.state = _stale.settled(state)

    @contextlib.contextmanager
    def unmarked(self) -> Iterator[None]:
        """torch's plain classes on this model's tensors for the duration, their values left as
        they are: a capture (torch.export) traces the model and must see plain tensors."""
        marked = [m for m in list(self._peers) if isinstance(m, Mirror) and m._marked is not None]
        for mirror in marked:
            mirror._unmark()
        try:
            yield
        finally:
            for mirror in marked:
                if not mirror.torch_current:
                    mirror._mark()

    # -- torch's view ----------------------------------------------------------------------------

    def sync(self) -> None:
        """Writes the device values into the model's parameters and buffers and the optimizer's
        state (one crossing per array; nothing to do when torch is already current)."""
        self._unmark()  # plain classes first: the writes below must not come back here
        if self.torch_current or not self.device_current:
            return  # torch holds the newest values already
        from tpudist import _profile
        try:  # (concrete values even where torch code runs while a step is traced: a deferred decomposition)
            with _profile.span("tpudist.torch_sync", arrays=len(self.layout)), jax.ensure_compile_time_eval():
                self._sync()
        except BaseException:
            self._mark()  # still stale: a later read tries again
            raise

    def stale_read(self) -> None:
        """A read through torch of a tensor the steps left stale (see `_stale`): syncs, unless the
        sync is a collective (sharded over processes), which one process's read cannot start."""
        if self.placement.spmd and jax.process_count() > 1 and any(
                tuple(self.placement.param_split(e)) for e in self.layout.entries):
            raise RuntimeError(
                f"rank {jax.process_index()}: a tensor that the sharded fused step trains was read after a step "
                f"and before a door; its newest values are sharded over {jax.process_count()} processes and "
                "gathering them is a collective every process must join: call step.sync() (or model.state_dict()) "
                "on every process first")
        self.sync()

    def _sync(self) -> None:
        self.flush_holder()
        counts = np.asarray(self._host(self.counts, False), dtype=np.float32).reshape(-1)
        optimizer_state = self.optimizer.state
        with torch.no_grad():
            for i, entry in enumerate(self.layout.entries):
                p, cfg = entry.param, entry.config
                value = self._host(self.params[i], self.placement.param_split(entry))
                if hollow(p):  # initialised on the devices only (_meta): torch gets its own tensor now
                    p.data = _fresh(value, p.dtype)
                else:
                    _write(p, value)  # (not p.data: its version counter tells the other steps of this model)
                if not cfg.state or (cfg.kind == _optim.OptimizerKind.SGD and counts[i] == 0):
                    continue  # torch keeps no state for it (yet)
                state = optimizer_state[p]
                for field, array in zip(cfg.state, self.states[i]):
                    value = self._host(array, self.placement.param_split(entry))
                    if isinstance(state.get(field), torch.Tensor) and state[field].shape == p.shape:
                        _write(state[field], value)
                    else:
                        state[field] = _fresh(value, p.dtype)
                if cfg.kind == _optim.OptimizerKind.ADAM:  # in place, as torch.optim counts (one held sees it)
                    step = state.get("step")
                    if isinstance(step, torch.Tensor) and step.numel() == 1 and step.is_floating_point():
                        step.fill_(float(counts[i]))
                    else:
                        state["step"] = torch.tensor(float(counts[i]), dtype=torch.float32)
            for key in self.updated_keys:  # the rest of `named` is what torch uploaded, unchanged
                _write(self.named_sources[key](), self._host(self.named[key], False))
        self._remember_torch([float(c) for c in counts])
        self.torch_current = True

    def _host(self, array: jax.Array, split: bool) -> HostValue:
        return host_value(self.placement, array, split)

    def torch_changed(self) -> None:
        """torch's objects were loaded from elsewhere: they are the truth for the next step."""
        self.device_current = False
        self.torch_current = True

    # -- checkpoints ------------------------------------------------------------------------------

    def state_tree(self) -> dict[str, Any]:
        """The training state as it is on the devices (for `tpudist.checkpoint.save`): parameters,
        optimizer state and step counts per layout entry, and the model's buffers (the newest
        values: the device's for those a graph updates, torch's for the rest). Needs the device
        state (`prepare()` first)."""
        self.flush_holder()
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
        self._unmark()  # torch's values are replaced, not read: no sync
        self.flush_holder()
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
        self._mark()


def host_value(placement: "Placement", array: jax.Array, split: bool) -> HostValue:
    """This process's part of `array` for torch (one crossing per local block)."""
    blocks = [to_host(b) for b in placement.local_blocks(array, split)]
    if len(blocks) == 1:
        return blocks[0]
    return torch.cat([torch.as_tensor(b) for b in blocks])


def _as_torch(value: HostValue) -> torch.Tensor:
    """A host value as a torch tensor, only ever read (copied from)."""
    if isinstance(value, torch.Tensor):
        return value
    value = np.asarray(value)
    with warnings.catch_warnings():  # a device_get result is read-only; torch warns, we only read it
        warnings.simplefilter("ignore", UserWarning)
        if value.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: reinterpret the bits
            return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(value)


def _write(target: torch.Tensor, value: HostValue) -> None:
    target.copy_(_as_torch(value).reshape(target.shape))


def _fresh(value: HostValue, dtype: torch.dtype) -> torch.Tensor:
    return _as_torch(value).to(dtype).clone()


def _install_hooks(mirror: Mirror, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
    """The doors: hooks that sync before torch reads the state and hand the truth to torch after it
    loads new state. They hold the mirror weakly (a dropped step leaves only inert hooks)."""
    sync, loaded = _Door(mirror, "sync"), _Door(mirror, "loaded")
    handles = [optimizer.register_state_dict_pre_hook(sync),
               optimizer.register_load_state_dict_pre_hook(sync),
               optimizer.register_load_state_dict_post_hook(loaded)]
    for module in model.modules():  # any submodule's state_dict, load_state_dict or forward
        handles += [module.register_state_dict_pre_hook(sync), module.register_load_state_dict_pre_hook(sync),
                    module.register_load_state_dict_post_hook(loaded), module.register_forward_pre_hook(sync)]
    return handles


class _Door:
    """One hook of `_install_hooks`: `sync` (before torch reads) or `loaded` (after it loads). A
    pickled or deep-copied model carries it inert (the copy is not trained by the step)."""

    noop_while_exporting = True  # (so a layer hooked by it may be traced once: lowering/_siblings.py)

    def __init__(self, mirror: Mirror | None, action: str):
        self._ref = weakref.ref(mirror) if mirror is not None else lambda: None
        self._action = action

    def __call__(self, *_: Any, **__: Any) -> None:
        target = self._ref()
        if target is None:
            return
        if self._action == "loaded":
            target.torch_changed()
        elif not _exporting():
            target.sync()

    def __reduce__(self) -> tuple:
        return (_Door, (None, self._action))

    def __deepcopy__(self, memo: dict) -> "_Door":
        return _Door(None, self._action)


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())
