"""Deferred imports for the per-host agent: modules that are imported but never used stay unloaded.

Starting the agent is most of what a host costs the launcher (docs/launcher.md): a Python process
that imports grpc and protobuf. Some of what those import, the agent never uses: `grpc/__init__`
imports `grpc.aio` (and with it `asyncio`, `ssl`, `inspect`), and protobuf's descriptor pool imports
its pure-Python message implementation although the upb one is in use. `defer(names)` puts a
placeholder for each named module in `sys.modules`; an `import` of it binds the placeholder, and the
first attribute read on it (other than `__spec__`, `__name__`, `__class__`) loads the real module
into that same object, so code that does use it gets the whole module. Only the agent's own
process does this (`python -m tpudist.launch.agent`); measured in docs/launcher.md.

A module already imported, or one that cannot be found, is left alone.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterable

# attributes the import system reads from a module in sys.modules without using its contents
_PASSIVE = frozenset({"__spec__", "__name__", "__class__"})


class _Deferred(types.ModuleType):
    """A module whose code runs on the first attribute read (then it is a plain module)."""

    def __getattribute__(self, attr: str) -> object:
        if attr in _PASSIVE:
            return super().__getattribute__(attr)
        _load(self)
        return getattr(self, attr)

    def __setattr__(self, attr: str, value: object) -> None:
        _load(self)
        setattr(self, attr, value)

    def __delattr__(self, attr: str) -> None:
        _load(self)
        delattr(self, attr)


def _load(module: types.ModuleType) -> None:
    # from here on its own code and every reader see a plain module (object's setattr: ours would recurse)
    object.__setattr__(module, "__class__", types.ModuleType)
    spec = module.__spec__
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)  # as a failed import does: the next import tries again
        raise


def _spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The module's spec, found without importing it (nor, for a submodule, its parent)."""
    parent, _, _ = name.rpartition(".")
    try:
        if not parent:
            return importlib.util.find_spec(name)
        if parent in sys.modules:
            return importlib.util.find_spec(name)
        outer = _spec(parent)
        if outer is None or not outer.submodule_search_locations:
            return None
        return importlib.machinery.PathFinder.find_spec(name, outer.submodule_search_locations)
    except (ImportError, ValueError):
        return None


def defer(names: Iterable[str]) -> list[str]:
    """Defers each named module not yet imported; returns the names deferred."""
    deferred = []
    for name in names:
        if name in sys.modules:
            continue
        spec = _spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            continue
        module = importlib.util.module_from_spec(spec)
        module.__class__ = _Deferred
        sys.modules[name] = module
        deferred.append(name)
    return deferred


def is_loaded(name: str) -> bool:
    """Whether `name` is imported and, if it was deferred, actually loaded."""
    module = sys.modules.get(name)
    return module is not None and type(module) is not _Deferred
