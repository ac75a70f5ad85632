"""Deferred imports for the per-host agent: modules that are imported but never used stay unloaded.

Starting the agent is most of what a host costs the launcher (docs/launcher.md): a Python process
that imports grpc and protobuf. Some of what those import, the agent never uses: `grpc/__init__`
imports `grpc.aio` (and with it `asyncio`, `ssl`, `inspect`), and protobuf's descriptor pool imports
its pure-Python message implementation although the upb one is in use. After `defer(names)`, an
import of a named module goes through the import system as usual (its parent package first; the
module bound in `sys.modules` and on its parent) but creates the module without running its code;
the first attribute read on it (other than `__spec__`, `__name__`, `__class__`) runs that code in
the same module object, so code that does use it gets the whole module. Only the agent's own
process does this (`python -m tpudist.launch.agent`, its `__main__`); measured in docs/launcher.md.

A module already imported is left alone; one that does not exist fails to import as usual.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Iterable

# what the agent defers: imported by grpc and protobuf, never used by the agent
AGENT_MODULES = ("asyncio", "grpc.aio", "google.protobuf.internal.python_message")

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


class _Loader:
    """Creates the module as the real loader would and leaves its code for the first use.

    (A loader and a finder by protocol only: importing `importlib.abc` would cost the agent pathlib,
    tempfile and more, ~15 ms.)"""

    def __init__(self, real) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self.real  # what _load runs, and what it shows
        module.__class__ = _Deferred


class _Finder:
    """First on sys.meta_path: for a deferred name, the spec the other finders give, with `_Loader`.

    The import itself goes through the import system as usual (parent package first, the name
    bound on the parent, sys.modules), so the placeholder is where the real module would be."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.names:
            return None
        self.names.discard(name)  # once: a failed load imports it plainly next time
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        # only Python source or bytecode: an extension module's code runs when it is created
        if not isinstance(spec.loader, (importlib.machinery.SourceFileLoader,
                                        importlib.machinery.SourcelessFileLoader)):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def defer(names: Iterable[str]) -> list[str]:
    """Defers each named module not yet imported (when something imports it, it gets the
    placeholder); returns the names deferred."""
    todo = {name for name in names if name not in sys.modules}
    if todo:
        sys.meta_path.insert(0, _Finder(todo))
    return sorted(todo)


def is_loaded(name: str) -> bool:
    """Whether `name` is imported and, if it was deferred, actually loaded."""
    module = sys.modules.get(name)
    return module is not None and type(module) is not _Deferred
