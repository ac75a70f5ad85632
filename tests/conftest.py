"""The suite's one shared setting: XLA's persistent compilation cache, where scripts/test names one.

`scripts/test` sets TPUDIST_CACHE_DIR (default: .cache/xla in the repository; `.ci/run` gives both
of its jobs one fresh directory). Every process of the suite then shares compiled executables:
this one, the OpInfo workers, and the programs the launcher's tests start (through `tpudist.init`).
The cache is JAX's own, keyed by the compiled program, so a changed lowering never hits an old
entry. Without TPUDIST_CACHE_DIR (plain `pytest`), this process compiles everything afresh.
"""

from __future__ import annotations

import os

from tpudist import contract


def pytest_configure(config) -> None:
    if os.environ.get(contract.CACHE_DIR):
        from tpudist._runtime import use_compilation_cache
        use_compilation_cache()
