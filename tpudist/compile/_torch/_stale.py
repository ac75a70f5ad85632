"""Reads of torch tensors that a fused step has left behind: each one syncs the step first.

Between a step and the next door (`_state`), the model's parameters, the optimizer's state and
the buffers a graph updates hold the values of the last sync. While they do, each of those
tensors wears a subclass of its own class (`Stale`; each mirror has its own, `classes_for`)
whose `__torch_function__` syncs the mirror that owns it, which puts the plain class back, and
only then runs the op. So any read through torch (`p.data`, `p.clone()`, `p.detach().numpy()`,
`torch.allclose(p, q)`, `p.norm()`, a pickle or a deepcopy) sees the newest values; the op's
results are plain tensors. The optimizer's `state` dict is swapped for a `StaleState` that syncs
on any access (`optimizer.state[p]["exp_avg"]`). Reads of metadata (`shape`, `dtype`, `.grad`,
`requires_grad`...) do not sync, so `optimizer.zero_grad()` stays free; nor does
`untyped_storage()`, asked for a size or an address (a read of values through the raw storage
is not a door).

The classes go on at the first step after a sync and come off at the sync: when nothing is stale,
torch ops on these tensors cost what they always cost, and a run of steps does no per-tensor work.
While its tensors are stale, a stale class holds its mirror strongly: a step dropped before its
values were read still hands them over at the first read (once they are read, nothing keeps a
dropped step's device arrays alive). Where a sync is a collective (a sharded step over several
processes gathers the shards), a read on one process would wait for the others forever: it
raises instead, saying to open a door on every process (`step.sync()`).

Only tensors of class `torch.nn.Parameter` or `torch.Tensor` are marked (a tensor subclass of
another kind keeps its own `__torch_function__`, and its reads need a door); a plain tensor taken
from a parameter before the step (`w = p.data`, `p.detach()`) is a different tensor and keeps the
values it had.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Protocol

import torch

__all__ = ["Owner", "Stale", "StaleState", "classes_for", "mark", "unmark"]


class Owner(Protocol):
    """The mirror that holds a stale tensor's newest values."""

    optimizer: torch.optim.Optimizer

    def sync(self) -> None: ...

    def stale_read(self) -> None:
        """Syncs for a read of one of its stale tensors (or raises where one process cannot)."""


def _metadata() -> frozenset:
    """torch functions that read no values: they run without a sync."""
    tensor = torch.Tensor
    getters = ("grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "_version",
               "grad_fn", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names",
               "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks")
    setters = ("grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "stride", "storage_offset", "data_ptr", "element_size",
               "is_floating_point", "is_complex", "is_contiguous", "__len__", "get_device", "requires_grad_",
               "register_hook", "register_post_accumulate_grad_hook", "_is_view", "is_shared", "is_pinned",
               "untyped_storage")  # (its size and address: a read of values through it is not a door)
    found = [getattr(getattr(tensor, n, None), "__get__", None) for n in getters]
    found += [getattr(getattr(tensor, n, None), "__set__", None) for n in setters]
    found += [getattr(tensor, n, None) for n in methods]
    return frozenset(f for f in found if f is not None)


_METADATA = _metadata()


class Stale:
    """A tensor whose newest values its mirror (`_stale_owner`) holds (see the module docstring)."""

    __slots__ = ()
    _stale_owner: Owner | None = None
    _stale_base: type = torch.Tensor  # the class it wears when current

    @classmethod
    def __torch_function__(cls, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in _METADATA:
            for kind in types:  # every stale tensor among the arguments, whichever mirror owns it
                owner = getattr(kind, "_stale_owner", None)
                if owner is not None:
                    owner.stale_read()  # writes the newest values and puts the plain classes back
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def __deepcopy__(self, memo: dict) -> Any:  # Parameter's copies type(self): sync first, copy a plain one
        _settle(self)
        return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        _settle(self)
        return self.__reduce_ex__(protocol)


class _StaleParameter(Stale, torch.nn.Parameter):
    __slots__ = ()
    _stale_base = torch.nn.Parameter


class _StaleTensor(Stale, torch.Tensor):
    __slots__ = ()
    _stale_base = torch.Tensor


def _settle(tensor: Stale) -> None:
    """Syncs `tensor`'s mirror; a tensor still marked after it (its mirror gone) goes plain."""
    owner = type(tensor)._stale_owner
    if owner is not None:
        owner.stale_read()
    if isinstance(tensor, Stale):
        tensor.__class__ = type(tensor)._stale_base


def classes_for() -> dict[type, type]:
    """A mirror's own stale classes, by the plain class they stand for (`mark` names their owner)."""
    return {base: type(stale.__name__.lstrip("_"), (stale,), {"__slots__": ()})
            for base, stale in ((torch.nn.Parameter, _StaleParameter), (torch.Tensor, _StaleTensor))}


def mark(tensors: list[torch.Tensor], classes: dict[type, type], owner: Owner) -> list[torch.Tensor]:
    """Puts `owner`'s stale classes on `tensors` (those of a plain class, each once); returns those
    marked."""
    for stale in classes.values():
        stale._stale_owner = owner
    marked = []
    for tensor in tensors:
        stale = classes.get(type(tensor))
        if stale is not None:
            tensor.__class__ = stale
            marked.append(tensor)
    return marked


def unmark(tensors: list[torch.Tensor], classes: dict[type, type]) -> None:
    for tensor in tensors:
        if isinstance(tensor, Stale):
            tensor.__class__ = type(tensor)._stale_base
    for stale in classes.values():
        stale._stale_owner = None  # no reference from the classes to the owner while nothing is stale


class StaleState(collections.defaultdict):
    """An optimizer's `state` while a fused step holds newer values: any access syncs the step,
    then goes to the optimizer's `state` as it is then (a plain `defaultdict` again)."""

    def __init__(self, owner: Owner, state: dict):
        super().__init__(dict, state)
        self._stale_owner = owner

    def current(self) -> collections.defaultdict:
        owner = self._stale_owner
        owner.stale_read()
        state = owner.optimizer.state
        if state is self:  # (a sync that could not run: the mirror holds no device state)
            owner.optimizer.state = state = settled(self)
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.current().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.current(), memo)

    def __copy__(self) -> Any:
        return copy.copy(self.current())


def settled(state: StaleState) -> collections.defaultdict:
    """A plain `defaultdict` with `state`'s entries; `state` is left empty (a reference kept to it
    reads the optimizer's state through it, never old entries)."""
    plain: collections.defaultdict = collections.defaultdict(dict)
    dict.update(plain, dict.items(state))
    dict.clear(state)
    return plain


def _forward(name: str) -> Any:
    def method(self: StaleState, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.current(), name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "__repr__",
              "__eq__", "__ne__", "__or__", "__ror__", "__ior__", "__reversed__", "get", "items",
              "keys", "values", "pop", "popitem", "setdefault", "update", "clear", "copy"):
    setattr(StaleState, _name, _forward(_name))
del _name
