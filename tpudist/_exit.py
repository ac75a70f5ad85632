"""Leaving a job: a graceful SIGTERM, and an exit that does not wait for peers that are gone.

Two things `tpudist.init()` sets up, after JAX's multi-process runtime has started (`install`):

- **SIGTERM ends the process gracefully.** JAX's preemption notifier takes SIGTERM over (it only
  records a preemption notice), so a stopped process would run on until SIGKILL. tpudist installs
  a handler that raises `SystemExit(143)` in the main thread instead: `finally:` blocks, context
  managers and atexit handlers run, and the process exits by itself within the launcher's
  --stop-grace. Not when the program set its own SIGTERM handler before `init()` (that one is put
  back, since JAX replaced it), nor with `init(handle_sigterm=False)`, which leaves JAX's notifier
  in place for programs that save a checkpoint at
  `jax.experimental.multihost_utils.reached_preemption_sync_point`. A program may also install
  its own handler after `init()`.

- **An abnormal exit does not wait for peers that will not come.** At exit JAX's atexit hook shuts
  the distributed runtime down, and that waits at a barrier for every other process, up to its
  shutdown timeout (300 s): after a collective timed out because a rank never arrived, the other
  ranks would hang there. So when this process exits after a SIGTERM or an uncaught exception
  (`abnormal`; a caught one changes nothing), it runs that shutdown on a thread and
  waits for it only briefly (`_deadline`: 0.25 s; rank 0, which serves the coordination service,
  until shortly before SIGKILL when stopped, 1 s after a collective error). When every peer is
  leaving too, the barrier completes in that time and the exit is JAX's usual one. Otherwise the
  process leaves without it, and, its status being known (1 after an uncaught exception, 143 after
  SIGTERM), ends at once with `os._exit`: a shutdown thread returning while Python finalizes would
  abort the process. Only the atexit handlers registered before `init()` are then skipped (logging
  and the standard streams are flushed). A normal exit still waits at the barrier as JAX does, so
  that rank 0 keeps serving ranks that finish later.

Standard library only until `install` runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# Why an exit is abnormal; the first reason given wins.
STOPPED = "stopped by SIGTERM"
COLLECTIVE_FAILED = "an uncaught collective error (a timeout, a peer gone)"
FAILED = "an uncaught exception"

_BARRIER_WAIT_S = 0.25  # enough for this process's arrival at the shutdown barrier to be recorded
_LEADER_WAIT_S = 1.0  # rank 0 after a collective failed: the other ranks are likely leaving too
_LEADER_STOP_MARGIN_S = 0.5  # rank 0, when stopped, leaves this long before SIGKILL is due

log = logging.getLogger("tpudist")
_reason: str | None = None  # None: a normal exit
_term_at: float | None = None  # when SIGTERM arrived
_leaving = False  # the atexit hook has run: a SIGTERM no longer raises
_state: dict[str, Any] = {}


def abnormal(reason: str) -> None:
    """Marks this process's coming exit as abnormal (`STOPPED`, `COLLECTIVE_FAILED`, `FAILED`): at exit
    it waits for its peers at JAX's shutdown barrier only briefly."""
    global _reason
    if _reason is None:
        _reason = reason


def install(rank: int, stop_grace: float, previous_sigterm: Any, handle_sigterm: bool) -> None:
    """Called once by `init()` after `jax.distributed.initialize` (so after JAX's own atexit hook:
    this module's runs before it). `previous_sigterm` is the Python SIGTERM handler before it."""
    _state.update(rank=rank, stop_grace=stop_grace)
    if threading.current_thread() is threading.main_thread():  # signal handlers: main thread only
        if previous_sigterm not in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, previous_sigterm)  # the program's own, which JAX displaced
        elif handle_sigterm:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _state["handler"] = True
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):  # an uncaught exception ends the main thread: the process fails
        abnormal(COLLECTIVE_FAILED if _from_collective(value) else FAILED)
        _state["uncaught"] = True
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _from_collective(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is a collective's failure (a timeout, a peer gone)."""
    collectives = sys.modules.get("tpudist.collectives")
    kind = getattr(collectives, "CollectiveError", None)
    seen = set()
    while error is not None and kind is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _term_at
    if _term_at is not None or _leaving:  # already leaving: let the cleanup under way finish
        _term_at = _term_at or time.monotonic()
        return
    _term_at = time.monotonic()
    abnormal(STOPPED)
    raise SystemExit(128 + signum)


def _at_exit() -> None:
    global _leaving
    _leaving = True
    try:
        if _reason is not None:  # else a normal exit: JAX's own hook waits for every peer
            start = time.monotonic()
            _leave(lambda: _deadline(start))
    finally:
        if _state.get("handler"):
            # From here a SIGTERM (the launcher stopping the job) must not kill the process before
            # it exits with its own status. (Python puts SIG_DFL back for its own handlers when it
            # finalizes; SIG_IGN stays.)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _deadline(start: float) -> float:
    """When a process that began leaving at `start` stops waiting at the shutdown barrier (rank 0's
    moves when a SIGTERM comes in meanwhile)."""
    wait = _BARRIER_WAIT_S
    if _state.get("rank") == 0:  # it serves the coordination service: the others may just go
        if _term_at is not None:  # stopped: so are the others; stay until shortly before SIGKILL
            wait = max(wait, _term_at + _state["stop_grace"] - _LEADER_STOP_MARGIN_S - start)
        elif _reason == COLLECTIVE_FAILED:  # the other ranks are likely leaving too
            wait = max(wait, _LEADER_WAIT_S)
    return start + wait


def _leave(deadline: Callable[[], float]) -> None:
    """JAX's distributed shutdown, waited for until `deadline()`; past that, left unfinished.

    The shutdown runs on a thread of its own. If it has not finished in time, the runtime's
    objects are leaked on purpose (their C++ destructors would shut down, and wait, all the same)
    and taken off JAX's state, so that JAX's atexit hook finds nothing left to shut down."""
    import tpudist._jaxcompat as _jaxcompat

    state = _jaxcompat.distributed_state()
    if state.client is None:
        return
    kept = [state.preemption_sync_manager, state.client, state.service]
    done = threading.Event()

    def shutdown() -> None:
        try:
            state.shutdown()
        except Exception:  # noqa: BLE001 - e.g. the barrier failed because a peer is gone
            pass
        done.set()

    threading.Thread(target=shutdown, name="tpudist-leave", daemon=True).start()
    while time.monotonic() < deadline():
        if done.wait(0.05):
            return
    import ctypes

    for obj in kept:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never destroyed: exit without waiting
    state.preemption_sync_manager = state.client = state.service = None
    log.debug("left the job without JAX's shutdown barrier (%s)", _reason)
    # The shutdown thread returns when the barrier completes or fails (a peer arrives late, rank 0
    # exits); if that happens while Python finalizes, the thread's exit aborts the process
    # ("FATAL: exception not rethrown"). So, when the exit status is known, end here.
    code = 1 if _state.get("uncaught") else 128 + signal.SIGTERM if _reason == STOPPED else None
    if code is not None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
