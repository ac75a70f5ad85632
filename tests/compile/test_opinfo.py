"""Every OpInfo of torch's database through `tpudist.compile`, against eager torch (opinfo_harness.py).

One test per OpInfo: its outcome per stage (forward, gradient, bfloat16 forward) must be the one
`opinfo_expected.csv` records, in either direction: a stage that starts passing fails the test
until the table says so, so coverage only grows and every fix updates the table. A wrong value
fails whatever the table says. After a change to the lowerings:

    TPUDIST_OPINFO_UPDATE=1 ./scripts/test tests/compile/test_opinfo.py

rewrites the table (the rows run) and the tables generated from it in docs/torch.md and docs/ops.md.

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
EXPECTED = harness.read_table() if harness.TABLE.exists() else {}
_observed: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _update_table():
    yield
    if UPDATE and _observed:
        table = {name: row for name, row in EXPECTED.items() if name in OPS}
        table.update(_observed)
        harness.write_table(table)
        _write_docs(table)


def _write_docs(table: dict[str, dict[str, str]]) -> None:
    torch_md = harness.DOCS / "torch.md"
    torch_md.write_text(harness.splice(torch_md.read_text(), harness.render_summary(table)))
    (harness.DOCS / "ops.md").write_text(harness.render_full(table))


def _start_worker(path: str) -> None:
    sys.path.insert(0, path)


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
    _observed[name] = outcome
    wrong = [f"{stage}: {value}" for stage, value in outcome.items() if value.startswith("WRONG")]
    assert not wrong, f"{name}: a wrong value without an error: {wrong}"
    if UPDATE:
        return
    expected = EXPECTED.get(name)
    assert expected is not None, f"{name} is not in {harness.TABLE.name}; run with TPUDIST_OPINFO_UPDATE=1"
    changed = [f"{stage}: now {outcome[stage]!r}, the table says {expected[stage]!r}"
               for stage in harness.STAGES if outcome[stage] != expected[stage]]
    assert not changed, (f"{name}: {'; '.join(changed)}. If this is a fix, rerun with TPUDIST_OPINFO_UPDATE=1 "
                         "to update the table")


def test_the_table_lists_every_opinfo_and_the_docs_are_generated_from_it():
    assert set(EXPECTED) == set(OPS), (f"not in the table: {sorted(set(OPS) - set(EXPECTED))[:10]}; no longer "
                                       f"OpInfos: {sorted(set(EXPECTED) - set(OPS))[:10]}")
    torch_md = (harness.DOCS / "torch.md").read_text()
    assert harness.render_summary(EXPECTED) in torch_md, "docs/torch.md's Ops table is stale: regenerate it"
    assert (harness.DOCS / "ops.md").read_text() == harness.render_full(EXPECTED), "docs/ops.md is stale"
