"""Dynamo's own guard of one compiled frame, evaluated without calling the frame.

`torch.compile` keeps, per code object, a list of cache entries: the guards under which a traced
version of the frame is valid, and the bytecode that calls its graph. `tpudist.generate`'s decode
loop (serve/_decode) uses one to start a batch's decoding on the device without first running a
decode step through dynamo: it asks whether the entry that traced the decode step holds for this
batch's decode inputs, exactly as dynamo would ask before calling it. Where it does not, or where
any of this cannot be read, the step goes through dynamo as before.

Private (checked on torch 2.13, 2.14.1 and 2.15.0): `torch._C._dynamo.eval_frame.
_debug_get_cache_entry_list(code)` (the entries; `torch._dynamo.eval_frame` wraps it for
debugging), an entry's `code` (its transformed bytecode, whose globals name the compiled graph as
`__compiled_fn_*` and any continuation after a graph break as `__resume_at_*`) and its
`guard_manager.check(frame_locals)`. Every failure to read them means: no guard, the slow path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_COMPILED = "__compiled_fn"
_RESUME = "__resume"


class FrameGuard:
    """Dynamo's guard of the cache entry that runs one graph for a frame of a function."""

    def __init__(self, manager: Any):
        self._manager = manager

    def holds(self, frame_locals: dict[str, Any]) -> bool:
        """Whether dynamo would run this entry for a call with `frame_locals` (the function's
        arguments by name) under the current global state (grad mode and the rest dynamo guards)."""
        try:
            return bool(self._manager.check(frame_locals))
        except Exception:  # noqa: BLE001 - an unreadable guard never holds
            return False


def frame_guard(function: Callable[..., Any], runs: Callable[[Any], bool]) -> FrameGuard | None:
    """The guard of the one cache entry of `function`'s code whose bytecode calls one compiled graph,
    the backend's callable that `runs` accepts, and nothing else dynamo made (no continuation after a
    graph break); None where there is no such entry, more than one, or torch's internals differ."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        entries = _debug_get_cache_entry_list(function.__code__)
        scope = function.__globals__
        found = []
        for entry in entries:
            names = entry.code.co_names
            compiled = [n for n in names if n.startswith(_COMPILED)]
            if len(compiled) != 1 or any(n.startswith(_RESUME) for n in names):
                continue
            callable_ = scope.get(compiled[0])
            if callable_ is not None and runs(getattr(callable_, "__wrapped__", callable_)):
                found.append(entry)
        return FrameGuard(found[0].guard_manager) if len(found) == 1 else None
    except Exception:  # noqa: BLE001 - torch's internals moved: no guard, the slow path
        return None
