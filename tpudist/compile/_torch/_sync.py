"""What the module and train rooms share about a torch module: who holds its newest values, and
the cache key of a call's leaves.

A fused step keeps a model's parameters on the devices between steps (train/_state.py's `Mirror`);
every door that reads the torch module (its state_dict, an eager call, `tpudist.compile(model)`)
first asks each mirror registered here to bring torch up to date.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

__all__ = ["Synced", "register", "mirrors_of", "sync_module", "leaf_key"]


class Synced(Protocol):
    """Device-resident state of a torch module that can write its newest values back into torch."""

    def sync(self) -> None: ...


# every mirror of a module (and of each of its submodules), so that any door can bring torch up to date
_MIRRORS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[Synced]]" = weakref.WeakKeyDictionary()


def register(model: torch.nn.Module, mirror: Synced) -> "weakref.WeakSet[Synced]":
    """Registers `mirror` for `model` and each of its submodules; returns every mirror of `model`."""
    for module in model.modules():  # a submodule read on its own is a door too
        _MIRRORS.setdefault(module, weakref.WeakSet()).add(mirror)
    return _MIRRORS[model]


def mirrors_of(module: torch.nn.Module) -> list[Synced]:
    return list(_MIRRORS.get(module, ()))


def sync_module(module: torch.nn.Module) -> None:
    """Brings `module`'s parameters and buffers (and the optimizers of fused steps training it) up
    to date with every fused step that trains it."""
    for mirror in mirrors_of(module):
        mirror.sync()


def leaf_key(leaf: Any) -> Any:
    """A call argument's part of a compiled signature: shape, dtype and device of a tensor, else the
    (hashable) value itself."""
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), repr(leaf))
    return (type(leaf), leaf)
