"""tpudist.profile: a 2-process job leaves one trace per rank that JAX's reader and TensorBoard's
profile plugin (xprof) open, holding tpudist's named spans; while no profile runs, spans do nothing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import pytest

import tpudist
from tpudist import _profile
from tpudist.testing import run_on_mesh

REDUCE = "tpudist.all_reduce[float32(4,5) sum]"
GROUPED = "tpudist.all_reduce[float32(3) max groups=[[0],[1]]]"


def _profiled_job(directory: str) -> dict:
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from tpudist.collectives import _ops

    rank = tpudist.process_index()
    mesh = tpudist.mesh.make_mesh({"data": -1})

    def train_step(w, x):
        return w - 0.1 * x.mean(), (w * x).sum()

    step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, P("data")))
    # Off: the instrumented call sites build no span at all (not even its name).
    real_span = _ops._span
    _ops._span = lambda *a, **k: (_ for _ in ()).throw(AssertionError("span built while not profiling"))
    try:
        tpudist.all_reduce(np.ones((4, 5), np.float32))
        tpudist.all_reduce([np.ones(2, np.float32), 3.0])
    finally:
        _ops._span = real_span

    @tpudist.traced("user.evaluate")
    def evaluate(w):
        return float(w)

    with pytest.raises(RuntimeError, match="no tpudist profile is recording"):
        tpudist.stop_profile()
    with tpudist.profile(directory) as rank_dir:
        assert tpudist.profiling() and rank_dir == Path(directory) / f"rank{rank}"
        with pytest.raises(RuntimeError, match="already recording"):
            tpudist.start_profile(directory)
        out = tpudist.all_reduce(np.full((4, 5), rank + 1, np.float32))
        np.testing.assert_array_equal(out, np.full((4, 5), 3, np.float32))
        tpudist.all_reduce(np.ones(3, np.float32), op="max", groups=[[0], [1]])
        tpudist.barrier()
        w = np.float32(1.0)
        for _ in range(3):
            w, loss = step(w, np.ones((4, 2), np.float32))
        jax.block_until_ready(loss)
        evaluate(w)
        with tpudist.span("user.block", epoch=7):
            pass
    assert not tpudist.profiling()
    return {"rank_dir": str(rank_dir), "trace": str(_profile._latest_trace(rank_dir))}


def _event_names(path: Path) -> set[str]:
    data = jax.profiler.ProfileData.from_file(str(path))
    return {e.name for plane in data.planes for line in plane.lines for e in line.events}


@pytest.mark.slow
def test_a_two_process_profile_leaves_a_readable_trace_per_rank_with_named_spans(tmp_path):
    results = run_on_mesh(_profiled_job, nprocs=2, cpu_devices=1, kwargs={"directory": str(tmp_path)})
    for rank, result in enumerate(results):
        trace = Path(result["trace"])
        assert trace.is_relative_to(tmp_path / f"rank{rank}" / "plugins" / "profile")
        assert trace.suffixes[-2:] == [".xplane", ".pb"] and trace.stat().st_size > 0

        # JAX's own reader
        names = _event_names(trace)
        for name in (REDUCE, GROUPED, "tpudist.barrier", "tpudist.step[train_step]",
                     "tpudist.compile_step[train_step]", "tpudist.step_inputs[train_step]",
                     "tpudist.compile_collective[all_reduce]",
                     "user.evaluate", "user.block"):
            assert name in names, f"rank {rank}: {name} missing from {sorted(n for n in names if 'tpudist' in n)}"
        # nothing from before the profile started: the unprofiled calls left no span
        assert not any(n.startswith("tpudist.all_reduce[float32(2)") for n in names)

        # TensorBoard's profile plugin (xprof) converts it for its trace viewer
        from xprof.convert import raw_to_tool_data
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], "trace_viewer", {})
        events = [e for e in json.loads(data)["traceEvents"] if e.get("name") == REDUCE]
        assert len(events) == 1 and events[0]["dur"] > 0
        assert events[0]["args"]["bytes"] == "80"
        assert [e["args"]["call"] for e in json.loads(data)["traceEvents"]
                if e.get("name") == "tpudist.step[train_step]"] == ["1", "2", "3"]

        # and the Perfetto file beside it is Chrome trace JSON with the same span
        with gzip.open(trace.parent / "perfetto_trace.json.gz") as f:
            perfetto = json.load(f)
        assert any(e.get("name") == REDUCE for e in perfetto["traceEvents"])


def test_span_is_a_shared_no_op_while_nothing_is_profiled():
    assert not tpudist.profiling()
    first, second = tpudist.span("a"), tpudist.span("b", rows=3)
    assert first is second is _profile.IDLE
    with first as entered:
        assert entered is None
    with pytest.raises(ZeroDivisionError):  # a no-op span never swallows the block's error
        with tpudist.span("c"):
            1 / 0
    with pytest.raises(TypeError, match=r"@tpudist.traced"):
        @tpudist.span("d")
        def f():
            pass

    @tpudist.traced
    def add(a, b=1):
        """adds"""
        return a + b

    @tpudist.traced("named")
    def sub(a, b):
        return a - b

    assert add(2, b=3) == 5 and sub(5, 2) == 3
    assert add.__name__ == "add" and add.__doc__ == "adds"
