"""The suite's two shared settings: XLA's persistent compilation cache, and how XLA:CPU compiles.

The cache, where scripts/test names one. `scripts/test` sets TPUDIST_CACHE_DIR (default: .cache/xla
in the repository; `.ci/run` gives both of its jobs one fresh directory). Every process of the suite
then shares compiled executables: this one, the OpInfo workers, and the programs the launcher's
tests start (through `tpudist.init`). The cache is JAX's own, keyed by the compiled program and
XLA's flags, so a changed lowering never hits an old entry. Without TPUDIST_CACHE_DIR (plain
`pytest`), this process compiles everything afresh.

How XLA:CPU compiles. Most of the suite's time is XLA:CPU compiling small programs it runs once or
a few times. The suite checks what tpudist asks XLA to compute, not how fast XLA:CPU's code runs, so
every process of it (the processes it starts inherit this environment) compiles with XLA:CPU's loop
emitters instead of its MLIR fusion emitters, and LLVM at -O0: `SUITE_XLA_FLAGS`, added to
XLA_FLAGS. What they change in float32 results is whether a multiply-add is fused into one rounding,
and a few ulps of tanh and rsqrt (docs/bench/HISTORY.md): rounding of the kind eager torch's own
results vary by between thread counts, which the comparisons against eager torch allow for
(test_zoo.py takes eager's error at its default thread count and at one thread). TPUDIST_TEST_XLA_DEFAULTS=1 runs the suite with XLA's own
defaults. The benchmarks (`scripts/bench_*.py`, run by hand) keep XLA's defaults; the tests that
run them at tiny sizes check only that they work.
"""

from __future__ import annotations

import os

from tpudist import contract


SUITE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")


def pytest_configure(config) -> None:
    if not os.environ.get("TPUDIST_TEST_XLA_DEFAULTS"):
        given = os.environ.get("XLA_FLAGS", "").split()
        named = {f.split("=")[0] for f in given}
        os.environ["XLA_FLAGS"] = " ".join(given + [f for f in SUITE_XLA_FLAGS if f.split("=")[0] not in named])
    if os.environ.get(contract.CACHE_DIR):
        from tpudist._runtime import use_compilation_cache
        use_compilation_cache()
