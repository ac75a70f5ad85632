"""`tpudist.profile`: one device + host trace per process, and tpudist's named spans inside it.

    with tpudist.profile("logs/profile"):          # every process, like any collective
        for batch in loader:
            loss = step(batch)
    # logs/profile/rank0/plugins/profile/<run>/<host>.xplane.pb   (TensorBoard's profile plugin)
    #                                        /perfetto_trace.json.gz (ui.perfetto.dev)
    # logs/profile/rank1/...

The trace is JAX's profiler's (`jax.profiler.start_trace`): XLA's compile and execute events,
the runtime's host threads, and the spans tpudist and the program name with `span`. tpudist names
its eager collectives with their signature (`tpudist.all_reduce[float32(4,5) sum]`), its compiled
steps (`tpudist.step[train_step]`, `tpudist.compile_step[train_step]`), a step's argument
crossing to the devices (`tpudist.step_inputs[train_step]`) and buffer imports
(`tpudist.import_buffer`).

When no profile is active a span is a check of the module flag `active` and a shared do-nothing
context manager: nothing is recorded and no object is built (docs/observability.md has the
measured cost). tpudist's own call sites test `active` before building a span's name, so an
unprofiled collective does not even format its signature.

Nothing here imports jax at module level: `import tpudist` must not import it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tpudist._jaxcompat as _jaxcompat

# True between start_profile() and stop_profile(). Read it, never write it, outside this module:
# `if _profile.active:` is the whole cost of an instrumented site while nothing is being traced.
active = False

_lock = threading.Lock()
_rank_dir: Path | None = None
_annotation: Any = None  # jax.profiler.TraceAnnotation, bound when the first profile starts


class _Idle:
    """The span of a process that is not being traced: enters and leaves, records nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:  # not *exc: no tuple per call
        return None

    def __call__(self, fn: Any) -> Any:
        raise TypeError("tpudist.span(...) is a context manager (`with tpudist.span(name): ...`); "
                        "to trace every call of a function, decorate it with @tpudist.traced(name)")


IDLE = _Idle()


def span(name: str, /, **fields: Any) -> contextlib.AbstractContextManager[None]:
    """A named span on this process's trace timeline, covering the `with` block.

    `fields` become the event's arguments (shown beside it in TensorBoard's trace viewer and in
    Perfetto): numbers and strings as they are, anything else as its str(). While no profile is
    active it returns a shared do-nothing context manager. Build an expensive name only when
    `tpudist.profiling()` is true. Example::

        with tpudist.span("data.next_batch", epoch=epoch):
            batch = next(it)
    """
    if not active:
        return IDLE
    return _annotation(name, **fields)


def traced(name: str | None = None, /, **fields: Any) -> Any:
    """Decorator: every call of the function is a span named `name` (default: its qualified name)
    while a profile is active; a flag check otherwise. Example::

        @tpudist.traced("train.eval")
        def evaluate(model, loader): ...
    """
    import functools

    def decorate(fn: Any) -> Any:
        label = name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not active:
                return fn(*args, **kwargs)
            with span(label, **fields):
                return fn(*args, **kwargs)
        return wrapper

    if callable(name):  # bare @tpudist.traced
        fn, name = name, None
        return decorate(fn)
    return decorate


def profiling() -> bool:
    """Whether this process is recording a `tpudist.profile` trace now."""
    return active


def start_profile(directory: str | Path, *, python: bool = False, perfetto: bool = True,
                  options: Any = None) -> Path:
    """Starts recording this process's trace into `directory/rank<R>/`; returns that directory.

    Call it on every process (each records its own). `python=True` also records every Python
    function call (JAX's Python tracer: a complete picture of the host, at several times the
    host time); `perfetto=False` skips the `perfetto_trace.json.gz` written beside the
    TensorBoard trace at the end. `options`, a `jax.profiler.ProfileOptions`, replaces both
    choices with yours. Joins the job first if needed (`tpudist.init()`), so that JAX starts
    with the job's settings. RuntimeError if a profile is already running in this process.
    """
    global active, _rank_dir, _annotation
    from tpudist._runtime import job as current_job
    job = current_job()
    import jax
    with _lock:
        if _rank_dir is not None:
            raise RuntimeError(f"rank {job.rank}: a tpudist profile is already recording into {_rank_dir}; "
                               "stop it (tpudist.stop_profile()) before starting another")
        rank_dir = Path(directory) / f"rank{job.rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        if options is None:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 1 if python else 0
        try:
            jax.profiler.start_trace(str(rank_dir), create_perfetto_trace=perfetto,
                                     profiler_options=options)
        except RuntimeError as e:
            raise RuntimeError(f"rank {job.rank}: cannot start a tpudist profile in {rank_dir}: {e} "
                               "(is jax.profiler already tracing? stop it first)") from e
        _annotation = jax.profiler.TraceAnnotation
        _rank_dir = rank_dir
        active = True
        _jaxcompat.tracer = span  # buffer imports and assemblies: spans too
    return rank_dir


def stop_profile() -> Path:
    """Stops this process's trace and writes it; returns the `.xplane.pb` file written (TensorBoard's
    format; `perfetto_trace.json.gz` lies beside it). RuntimeError if no profile is running."""
    global active, _rank_dir
    import jax
    with _lock:
        if _rank_dir is None:
            raise RuntimeError("no tpudist profile is recording in this process; start one with "
                               "tpudist.start_profile(directory) or `with tpudist.profile(directory):`")
        rank_dir, _rank_dir = _rank_dir, None
        active = False
        _jaxcompat.tracer = None
        jax.profiler.stop_trace()
    return _latest_trace(rank_dir)


def _latest_trace(rank_dir: Path) -> Path:
    """The newest `<host>.xplane.pb` under `rank_dir/plugins/profile/<run>/`."""
    found = sorted(rank_dir.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"JAX's profiler wrote no trace under {rank_dir}/plugins/profile")
    return found[-1]


@contextlib.contextmanager
def profile(directory: str | Path, *, python: bool = False, perfetto: bool = True,
            options: Any = None) -> Iterator[Path]:
    """Records a trace of everything inside the block, on every process that enters it, into
    `directory/rank<R>/` (yielded). See `start_profile` for the options. Open it with
    `tensorboard --logdir DIRECTORY` (Profile tab, after `pip install tensorboard-plugin-profile`)
    or drop `perfetto_trace.json.gz` on ui.perfetto.dev. Example::

        with tpudist.profile("logs/profile"):
            for _ in range(5):
                params, opt_state, loss = step(params, opt_state, batch)
            jax.block_until_ready(loss)   # steps are asynchronous: wait inside the profile
    """
    rank_dir = start_profile(directory, python=python, perfetto=perfetto, options=options)
    try:
        yield rank_dir
    finally:
        stop_profile()
