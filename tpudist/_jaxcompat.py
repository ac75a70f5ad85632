"""Every private JAX API tpudist uses, in one module, so that a JAX upgrade touches one file.

Written against jax / jaxlib 0.10.2 (`CHECKED_ON`). Each function names the private call it makes,
why the public one does not do, and what happens where the private call is gone: the public
fallback it takes, or the error `moved` words (which API, which JAX, what to pin). `tests/runtime/test_jaxcompat.py` fails on a JAX where one of them has
silently fallen back, so an upgrade shows which one to look at.

Nothing here imports jax at module level: `tpudist._runtime` imports this module, and `import
tpudist` (the launcher included) must not import jax. Nor does it import any tpudist module, so that
every layer can use it: the profiler hands its span in (`tracer`) rather than being imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_DL_CPU = 1  # DLPack's kDLCPU

# Every private call below was checked on these releases (tpudist/_versions.py lists what the suite runs).
CHECKED_ON = "jax/jaxlib 0.10.2"


def moved(api: str, error: BaseException) -> RuntimeError:
    """The error for a private JAX API this JAX release no longer has: which API, which release,
    what to pin."""
    import jax
    return RuntimeError(f"tpudist needs JAX's private {api}, which jax {jax.__version__} does not have "
                        f"({type(error).__name__}: {error}); it was checked on {CHECKED_ON}. Pin "
                        "jax==0.10.2 jaxlib==0.10.2 (`pip install 'jax==0.10.2' 'jaxlib==0.10.2'`), or "
                        "upgrade tpudist; tpudist._jaxcompat is where it needs updating.")

# `tpudist._profile.span` while a profile records, None otherwise (set by tpudist._profile): a
# buffer import or an assembly is then a named span on the trace.
tracer: Callable[..., Any] | None = None


def import_buffer(buffer: Any, device: Any) -> Any | None:
    """Wraps a CPU buffer (torch tensor, numpy array, or a DLPack capsule of one) as an XLA buffer on
    `device`, without a copy.

    Private: `jax._src.lib._jax.dlpack_managed_tensor_to_buffer` (checked on jaxlib 0.10.2). The public
    `jax.dlpack.from_dlpack` makes the same call and then dispatches a dtype canonicalization that
    costs ~10x the import itself. Returns None where the import is not possible (the private call
    moved, a dtype DLPack cannot carry, an unaligned buffer); the caller then takes the public path
    (`jax.dlpack.from_dlpack` or `jax.device_put`, a copy).
    """
    if not _settling:
        _settle_at_exit()
    if tracer is not None:  # a host -> device crossing, named on the trace
        with tracer("tpudist.import_buffer", bytes=getattr(buffer, "nbytes", -1)):
            return _import_buffer(buffer, device)
    return _import_buffer(buffer, device)


_settling = False  # the exit hook below is registered


def _settle_at_exit() -> None:
    """Registers, once, an exit hook that lets XLA finish with the buffers it imported.

    An imported buffer keeps its torch tensor alive; the last reference may be dropped on an XLA
    thread as an execution ends, and releasing a torch tensor takes the GIL. Once the interpreter
    is finalizing, a thread that asks for the GIL is ended by `pthread_exit`, which C++ turns into
    `std::terminate`: the process aborts (exit code 134, "terminate called without an active
    exception") after the program finished (measured: 1 in 10 processes that exit right after a
    12-layer model's step). The hook, which runs before finalization, collects garbage, waits for
    every live array and gives the executions' clean-up a moment to run."""
    global _settling
    import atexit
    _settling = True
    atexit.register(_settle)


SETTLE_S = 5.0  # the longest the exit hook waits for XLA (a collective whose peer is gone never ends)


def _settle() -> None:
    import gc
    import threading
    import time

    import jax

    def wait() -> None:
        for array in jax.live_arrays():
            try:
                array.block_until_ready()
            except Exception:  # noqa: BLE001 - a deleted or failed array: nothing left to wait for
                pass

    gc.collect()  # arrays in reference cycles: released now, while threads may still take the GIL
    waiter = threading.Thread(target=wait, name="tpudist-exit-settle", daemon=True)
    waiter.start()
    waiter.join(SETTLE_S)
    time.sleep(0.1)  # the executions' own clean-up runs on XLA's threads just after their outputs are ready


def _import_buffer(buffer: Any, device: Any) -> Any | None:
    try:
        from jax._src.lib import _jax
        capsule = buffer if type(buffer).__name__ == "PyCapsule" else buffer.__dlpack__()
        return _jax.dlpack_managed_tensor_to_buffer(capsule, device, None, None, _DL_CPU)
    except Exception:  # noqa: BLE001 - any failure means: take the portable path
        return None


def export_buffer(array: Any) -> Any | None:
    """A DLPack capsule sharing a single-device CPU `jax.Array`'s memory, once it is ready.

    Private: `jax._src.lib._jax.buffer_to_dlpack_managed_tensor` (checked on jaxlib 0.10.2), the call
    `jax.Array.__dlpack__` ends in; it waits until the array's computation is done. The public
    path adds device and sharding checks costing 4-12 us per array (measured on fresh outputs of
    an executable), which a compiled torch module pays on every output and gradient. Returns None
    for arrays on other platforms (their DLPack needs the consumer's stream) or where the call
    moved; the caller then takes `torch.from_dlpack(array)`.
    """
    try:
        if array.platform() != "cpu":
            return None
        from jax._src.lib import _jax
        return _jax.buffer_to_dlpack_managed_tensor(array)
    except Exception:  # noqa: BLE001 - any failure means: take the portable path
        return None


def assemble(shape: tuple[int, ...], sharding: Any, shards: list[Any]) -> Any:
    """The global `jax.Array` of `shape` laid out by `sharding` whose addressable shards are
    `shards` (one per local device, in the sharding's device order).

    Private: `jax._src.array.ArrayImpl(..., _skip_checks=True)` and `jax._src.core.ShapedArray`
    (checked on jax 0.10.2): a few microseconds, against ~50 us for the public
    `jax.make_array_from_single_device_arrays`, whose checks hold by construction for tpudist's
    callers. Public fallback: that call, where the private constructor moved.
    """
    if tracer is not None:
        with tracer("tpudist.assemble", shape=str(shape)):
            return _assemble(shape, sharding, shards)
    return _assemble(shape, sharding, shards)


def _assemble(shape: tuple[int, ...], sharding: Any, shards: list[Any]) -> Any:
    import jax
    try:
        from jax._src import array as jax_array
        from jax._src import core
        return jax_array.ArrayImpl(core.ShapedArray(shape, shards[0].dtype), sharding, shards,
                                   committed=True, _skip_checks=True)
    except Exception:  # noqa: BLE001 - private API moved: take the public path
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def backend_started() -> bool:
    """Whether JAX has already created its backends (after which XLA_FLAGS no longer apply).

    Private: `jax._src.xla_bridge.backends_are_initialized()` (checked on jax 0.10.2); every public way to ask
    (`jax.devices()`, `jax.default_backend()`) starts the backends. Fallback: False, where the call
    moved; `init()` then sets its XLA flags without checking that they can still take effect.
    """
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def distributed_client() -> Any:
    """The coordination service client of the running `jax.distributed` job (key-value store,
    barriers), or None where this process has not joined one.

    Private: `jax._src.distributed.global_state.client` (checked on jax 0.10.2). JAX has no public accessor;
    `jax.experimental.multihost_utils` reads the same object. No fallback: without the client,
    collectives could neither check their peers nor wait at a barrier, so a missing one is an
    error naming the JAX version rather than a silent single-process job.
    """
    try:
        from jax._src import distributed
        return distributed.global_state.client
    except (ImportError, AttributeError) as e:
        raise moved("jax._src.distributed.global_state.client (the coordination service client)", e) from e


def distributed_state() -> Any:
    """JAX's distributed runtime state object (`client`, `service`, `preemption_sync_manager`,
    `shutdown()`), for leaving a job without waiting in JAX's exit barrier (tpudist._exit).

    Private: `jax._src.distributed.global_state` (checked on jax 0.10.2); JAX has no public handle on it. No
    fallback: where it moved, tpudist._exit cannot bound the exit and says so.
    """
    try:
        from jax._src import distributed
        return distributed.global_state
    except (ImportError, AttributeError) as e:
        raise moved("jax._src.distributed.global_state (the distributed runtime state)", e) from e


def varying_axes(value: Any) -> frozenset[str]:
    """The shard_map mesh axes over which traced `value` varies: jax 0.10 keeps them in its
    aval's manual axis types (`mat`), other releases in `vma`."""
    import jax

    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    raise moved("varying-axis types of a shard_map value (the aval's `mat` or `vma`)",
                AttributeError(f"{type(aval).__name__} has neither `mat` nor `vma`"))


def cache_writes_from_every_process() -> bool:
    """Makes every process of a job write the programs it compiles to the persistent compilation
    cache, not process 0 alone, so that a restarted job's every process finds its own. Returns
    whether it is in place.

    JAX writes entries from process 0 only (so that hosts do not contend for one entry on a shared
    bucket), and its key holds each process's view of the topology: on a CPU mesh every process
    has keys of its own, and a TPU host whose cache is a local directory (tpudist's default) is
    cold after a restart everywhere but on host 0. `use_compilation_cache` puts this in place for
    local directories only.

    Private: wraps `jax._src.compiler._compile_and_write_cache`, which calls
    `jax._src.compilation_cache.put_executable_and_time` as JAX's own write does, honouring
    `jax_persistent_cache_min_compile_time_secs` (checked on jax 0.10.2). Fallback: where they moved,
    False: processes other than 0 compile again after a restart, as in JAX.
    """
    try:
        from jax._src import compilation_cache, compiler, config, distributed
        original = compiler._compile_and_write_cache
        put = compilation_cache.put_executable_and_time
        minimum_s = config.persistent_cache_min_compile_time_secs
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_tpudist_wrapped", False):
        return True
    import time

    def compile_and_write(backend, computation, executable_devices, compile_options, host_callbacks,
                          module_name, cache_key):
        start = time.monotonic()
        executable = original(backend, computation, executable_devices, compile_options, host_callbacks,
                              module_name, cache_key)
        seconds = time.monotonic() - start
        if distributed.global_state.process_id != 0 and not host_callbacks and seconds >= minimum_s.value:
            try:
                put(cache_key, module_name, executable, backend, int(seconds))
            except Exception as e:  # noqa: BLE001 - as JAX's own write: an entry not written costs a compile
                import warnings
                warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                              f"{type(e).__name__}: {e}")
        return executable

    compile_and_write._tpudist_wrapped = True
    compiler._compile_and_write_cache = compile_and_write
    return True
