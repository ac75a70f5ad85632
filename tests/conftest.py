"""The suite's two shared settings: XLA's persistent compilation cache, and how XLA:CPU compiles.

The cache, where scripts/test names one.

`scripts/test` sets TPUDIST_CACHE_DIR (default: .cache/xla in the repository; `.ci/run` gives both
of its jobs one fresh directory). Every process of the suite then shares compiled executables:
this one, the OpInfo workers, and the programs the launcher's tests start (through `tpudist.init`).
The cache is JAX's own, keyed by the compiled program, so a changed lowering never hits an old
entry. Without TPUDIST_CACHE_DIR (plain `pytest`), this process compiles everything afresh.

How XLA:CPU compiles. Most of the suite's time is XLA:CPU compiling small programs, and much of
that is its MLIR fusion emitters (mobilenet_v2's fused train step: 24 s with XLA's defaults, 15 s
with its older loop emitters). The suite checks what tpudist asks XLA to compute, not how fast
XLA:CPU's code runs, so every process of it (the processes it starts inherit this environment)
compiles with the loop emitters: `SUITE_XLA_FLAGS`, added to XLA_FLAGS. (LLVM at -O0 as well would
save another quarter, but changes float32 results: a CTC loss trained three steps lands 7x further
from float64 than eager torch.) TPUDIST_TEST_XLA_DEFAULTS=1 runs the suite with XLA's own defaults. The
benchmarks (`scripts/bench_*.py`, run by hand) keep XLA's defaults; the tests that run them at tiny
sizes check only that they work.
"""

from __future__ import annotations

import os

from tpudist import contract


SUITE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def pytest_configure(config) -> None:
    if not os.environ.get("TPUDIST_TEST_XLA_DEFAULTS"):
        given = os.environ.get("XLA_FLAGS", "").split()
        named = {f.split("=")[0] for f in given}
        os.environ["XLA_FLAGS"] = " ".join(given + [f for f in SUITE_XLA_FLAGS if f.split("=")[0] not in named])
    if os.environ.get(contract.CACHE_DIR):
        from tpudist._runtime import use_compilation_cache
        use_compilation_cache()
