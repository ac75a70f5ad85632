"""Every OpInfo of torch's database through `tpudist.compile`, against eager torch (opinfo_harness.py).

One test per OpInfo: its outcome per stage (forward, gradient, bfloat16 forward) must be the one
`opinfo_expected.csv` records, in either direction: a stage that starts passing fails the test
until the table says so, so coverage only grows and every fix updates the table. A wrong value
fails whatever the table says. After a change to the lowerings:

    TPUDIST_OPINFO_UPDATE=1 ./scripts/test tests/compile/test_opinfo.py

rewrites the table (the rows run) and the tables generated from it in docs/torch.md and docs/ops.md.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal imports it
import opinfo_harness as harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
UPDATE = os.environ.get("TPUDIST_OPINFO_UPDATE") == "1"
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


@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo(name):
    outcome = harness.check(OPS[name])
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
