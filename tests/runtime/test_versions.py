"""Which torch and JAX releases tpudist says it was tested on, and what a user on another one hears."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from tpudist import _versions


def test_the_running_torch_and_jax_are_releases_the_suite_declares_tested():
    # the suite (main job or compatibility job) only ever runs on releases it names as tested
    assert _versions.untested() == []


def test_an_untested_release_is_named_with_the_tested_ones(monkeypatch):
    monkeypatch.setattr(_versions, "installed", lambda p: {"torch": "2.99.1+cu999", "jax": "0.10.7"}.get(p))
    lines = _versions.untested()
    assert lines == [f"torch 2.99.1+cu999 is not a tested release (tested: {', '.join(_versions.TESTED['torch'])})"]


def test_the_warning_comes_once_per_process(monkeypatch):
    monkeypatch.setattr(_versions, "installed", lambda p: {"torch": "1.0.0", "jax": "0.10.2"}.get(p))
    monkeypatch.setattr(_versions, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _versions.warn_untested()
        _versions.warn_untested()
    found = [w for w in caught if issubclass(w.category, _versions.UntestedVersionWarning)]
    assert len(found) == 1 and "torch 1.0.0" in str(found[0].message) and "pin a tested release" in str(found[0].message)


def test_doctor_prints_the_versions_and_the_ops_this_torch_lacks():
    import torch

    from tpudist.compile._torch.lowering._table import missing_ops

    out = subprocess.run([sys.executable, "-m", "tpudist", "doctor"], capture_output=True, text=True, timeout=120)
    assert f"torch {torch.__version__.split('+')[0]}" in out.stdout, out.stdout + out.stderr
    assert "every installed release is a tested one" in out.stdout
    for name in missing_ops():
        assert name in out.stdout


def test_a_lowering_for_an_op_this_torch_lacks_is_skipped_and_listed():
    from tpudist.compile._torch.lowering import _registry, _table

    @_table.register(_table.aten.tpudist_no_such_op.default, _table.aten.relu.tpudist_no_such_overload)
    def lowering(x):
        return x

    assert "aten.tpudist_no_such_op.default" in _table.missing_ops()
    assert "aten.relu.tpudist_no_such_overload" in _table.missing_ops()
    assert not any("tpudist_no_such" in name for name in _registry.supported_ops())
    # an op that exists still resolves to torch's own overload
    import torch
    assert _table.aten.relu.default is torch.ops.aten.relu.default


@pytest.mark.parametrize("api", ["distributed_client", "distributed_state"])
def test_a_moved_private_jax_api_is_named_with_the_jax_to_pin(monkeypatch, api):
    from jax._src import distributed

    from tpudist import _jaxcompat

    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(RuntimeError, match=r"jax\._src\.distributed\.global_state.*checked on jax/jaxlib 0\.10\.2"
                                           r".*Pin jax==0\.10\.2"):
        getattr(_jaxcompat, api)()
