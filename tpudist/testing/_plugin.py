"""The pytest plugin: `@pytest.mark.tpudist(nprocs=N, cpu_devices=K, timeout=S)`."""

from __future__ import annotations

from typing import Any

import pytest

from tpudist.testing import DEFAULT_TIMEOUT, MARKER, run_on_mesh


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(nprocs=2, cpu_devices=1, timeout={DEFAULT_TIMEOUT:g}): run the test on "
        "every rank of a multi-process tpudist CPU mesh")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    if marker.args:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: use keywords, e.g. @pytest.mark.{MARKER}(nprocs=2)")
    options = {"nprocs": 2, "cpu_devices": 1, "timeout": DEFAULT_TIMEOUT, **marker.kwargs}
    unknown = set(options) - {"nprocs", "cpu_devices", "timeout", "env"}
    if unknown:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: unknown {MARKER} marker options {sorted(unknown)}")
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_on_mesh(pyfuncitem.obj, kwargs=kwargs, **options)
    return True
