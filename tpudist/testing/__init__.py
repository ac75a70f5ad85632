"""Testing distributed code the way tpudist tests its own: on a multi-process CPU mesh.

With tpudist installed, pytest loads its plugin (entry point `pytest11`), which adds a marker::

    import pytest, tpudist, numpy as np

    @pytest.mark.tpudist(nprocs=2, cpu_devices=2)
    def test_sum():
        total = tpudist.all_reduce(np.float32(tpudist.process_index()))
        assert total == 1.0          # runs on every rank; a failing rank's assertion is reported

The test function runs in `nprocs` fresh processes joined into one job (via `tpudist.spawn`), so
it must be a module-level function and its fixtures' values must be picklable. `run_on_mesh`
does the same from code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tpudist._spawn import SpawnError, spawn

__all__ = ["run_on_mesh", "MARKER"]

MARKER = "tpudist"
DEFAULT_TIMEOUT = 300.0


def _call(index: int, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    return fn(**kwargs)


def run_on_mesh(fn: Callable[..., Any], nprocs: int = 2, cpu_devices: int | None = 1,
                kwargs: dict[str, Any] | None = None, timeout: float = DEFAULT_TIMEOUT,
                env: dict[str, str] | None = None) -> Sequence[Any]:
    """Runs `fn(**kwargs)` on every rank of an `nprocs`-process CPU mesh; returns each rank's result.

    A failing rank raises AssertionError carrying that rank's index and traceback, so pytest shows
    the assertion that failed where it failed.
    """
    try:
        return spawn(_call, args=(fn, kwargs or {}), nprocs=nprocs, cpu_devices=cpu_devices,
                     timeout=timeout, env=env)
    except SpawnError as e:
        raise AssertionError(f"rank {e.index} of {nprocs} failed:\n{e.detail}") from None
