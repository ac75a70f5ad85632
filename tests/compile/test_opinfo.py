"""Every OpInfo of torch's database through `tpudist.compile`, against eager torch (opinfo_harness.py).

One test per OpInfo: its outcome per stage (forward, gradient, bfloat16 forward) must be the one
the running torch's table records (`opinfo_expected.csv` for the suite's torch, whose first line
names it; `opinfo_expected_<minor>.csv` for another release, e.g. `opinfo_expected_2.14.csv`), in
either direction: a stage that starts passing fails the test until the table says so, so coverage
only grows and every fix updates the table. A wrong value (a compiled result that differs from
eager torch's without an error) fails whatever the table says, and no table can record one. After a
change to the lowerings, with each torch release:

    TPUDIST_OPINFO_UPDATE=1 ./scripts/test tests/compile/test_opinfo.py
    TPUDIST_OPINFO_UPDATE=1 ./scripts/test-compat 2.14.1 tests/compile/test_opinfo.py

rewrites that release's table (the rows run); the suite's table also rewrites the tables generated
from it in docs/torch.md and docs/ops.md.

The checks run in `TPUDIST_OPINFO_WORKERS` processes (default: one per core, at most 2), started
when the module starts and fed one OpInfo at a time; each test waits for its own OpInfo's result.
A check is a capture and two or three XLA compilations, single-threaded for the most part, so two
processes halve the module's time on a 2-core machine.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal imports it
import opinfo_harness as harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
UPDATE = os.environ.get("TPUDIST_OPINFO_UPDATE") == "1"
WORKERS = int(os.environ.get("TPUDIST_OPINFO_WORKERS", min(2, os.cpu_count() or 1)))
RESULT_TIMEOUT = 600  # seconds a test waits for its OpInfo's result (the workers may be busy with others first)
OPS = harness.opinfos()
TABLE = harness.running_table()
EXPECTED = harness.read_table(TABLE) if TABLE.exists() else {}
_observed: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _update_table():
    yield
    if UPDATE and _observed:
        table = {name: row for name, row in EXPECTED.items() if name in OPS}
        table.update(_observed)
        harness.write_table(table, TABLE)
        if TABLE == harness.TABLE:
            _write_docs(table)


def _write_docs(table: dict[str, dict[str, str]]) -> None:
    torch_md = harness.DOCS / "torch.md"
    torch_md.write_text(harness.splice(torch_md.read_text(), harness.render_summary(table)))
    (harness.DOCS / "ops.md").write_text(harness.render_full(table))


def _start_worker(path: str) -> None:
    sys.path.insert(0, path)
    if os.environ.get("TPUDIST_CACHE_DIR"):  # the suite's compilation cache (tests/conftest.py)
        from tpudist._runtime import use_compilation_cache
        use_compilation_cache()


def _check(name: str) -> dict[str, str]:
    import opinfo_harness
    return opinfo_harness.check(opinfo_harness.opinfos()[name])


@pytest.fixture(scope="module")
def results(request):
    """Futures of every selected OpInfo's outcome, computed by the worker processes in test order."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params]
    pool = concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_start_worker, initargs=(str(Path(__file__).parent),))
    futures = {name: pool.submit(_check, name) for name in names}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo(name, results):
    outcome = results[name].result(timeout=RESULT_TIMEOUT)
    wrong = [f"{stage}: {outcome[stage]}" for stage in harness.STAGES if harness.is_wrong(outcome[stage])]
    assert not wrong, f"{name}: a wrong value without an error: {wrong}"
    _observed[name] = outcome  # (only now: an update never writes a wrong value into the table)
    if UPDATE:
        return
    expected = EXPECTED.get(name)
    assert expected is not None, f"{name} is not in {TABLE.name}; run with TPUDIST_OPINFO_UPDATE=1"
    changed = [f"{stage}: now {outcome[stage]!r}, the table says {expected[stage]!r}"
               for stage in harness.STAGES if outcome[stage] != expected[stage]]
    assert not changed, (f"{name}: {'; '.join(changed)}. If this is a fix, rerun with TPUDIST_OPINFO_UPDATE=1 "
                         "to update the table")


def test_the_table_lists_every_opinfo_and_the_docs_are_generated_from_it():
    assert TABLE.exists(), f"no expected table for torch {harness.torch_minor()}: run with TPUDIST_OPINFO_UPDATE=1"
    assert set(EXPECTED) == set(OPS), (f"{TABLE.name}: not in the table: {sorted(set(OPS) - set(EXPECTED))[:10]}; "
                                       f"no longer OpInfos: {sorted(set(EXPECTED) - set(OPS))[:10]}")
    documented = harness.read_table()  # the suite's torch, whichever runs
    torch_md = (harness.DOCS / "torch.md").read_text()
    assert harness.render_summary(documented) in torch_md, "docs/torch.md's Ops table is stale: regenerate it"
    assert (harness.DOCS / "ops.md").read_text() == harness.render_full(documented), "docs/ops.md is stale"


def test_no_table_can_expect_a_wrong_value(tmp_path):
    # a silent mismatch is reported as "WRONG: ...": the test fails on it, an update does not write
    # it, and a table edited by hand to expect it does not load
    path = tmp_path / "opinfo_expected.csv"
    row = {"forward": "pass", "gradient": "WRONG: gradient 0: compiled is 1.2e+00 from float64", "bf16": "n/a",
           "aten": ""}
    with pytest.raises(ValueError, match="wrong values for add"):
        harness.write_table({"add": row}, path)
    harness.write_table({"add": {**row, "gradient": "pass"}}, path)
    path.write_text(path.read_text().replace(",pass,pass,", ",pass,WRONG: by hand,"))
    with pytest.raises(ValueError, match="never an expected outcome"):
        harness.read_table(path)
