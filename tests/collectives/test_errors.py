"""Bad input to the collectives is a clear error on every rank, never a hang."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
import torch

import tpudist
from tpudist.testing import run_on_mesh


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e)
    return "no error", ""


def local_errors() -> dict:
    """Errors each process detects by itself, before any communication."""
    x = np.ones(4, np.float32)
    return {
        "op": _error(lambda: tpudist.all_reduce(x, op="average")),
        "dtype": _error(lambda: tpudist.all_reduce(np.ones(2, np.complex64))),
        "torch_dtype": _error(lambda: tpudist.all_reduce(torch.ones(2, dtype=torch.int16))),
        "kind": _error(lambda: tpudist.all_reduce("text")),
        "bool_sum": _error(lambda: tpudist.all_reduce(np.array([True]))),
        "int_mean": _error(lambda: tpudist.all_reduce(np.ones(2, np.int32), op="mean")),
        "unequal": _error(lambda: tpudist.all_reduce(x, groups=[[0], [1, 2], [3]])),
        "not_partition": _error(lambda: tpudist.all_reduce(x, groups=[[0, 1], [1, 2]])),
        "out_of_range": _error(lambda: tpudist.all_reduce(x, groups=[[0, 1], [2, 7]])),
        "indivisible": _error(lambda: tpudist.reduce_scatter(np.ones(6, np.float32))),
        "a2a_scalar": _error(lambda: tpudist.all_to_all(np.float32(1))),
        "dim": _error(lambda: tpudist.all_gather(x, dim=3)),
        "src": _error(lambda: tpudist.broadcast(x, src=4)),
        "pairs": _error(lambda: tpudist.collective_permute(x, [[0, 1], [2, 1]])),
        "both": _error(lambda: tpudist.all_reduce(x, axis="data", groups=[[0, 1, 2, 3]])),
        # After all of that, the collectives still work and agree.
        "after": tpudist.all_reduce(np.float32(1)),
    }


@pytest.fixture(scope="module")
def local() -> list[dict]:
    return run_on_mesh(local_errors, nprocs=4, cpu_devices=1, timeout=300)


@pytest.mark.parametrize("case, kind, words", [
    ("op", "ValueError", ["'average'", "sum", "mean", "max", "min", "prod"]),
    ("dtype", "TypeError", ["complex64", "float32"]),
    ("torch_dtype", "TypeError", ["int16", "bfloat16"]),
    ("kind", "TypeError", ["str", "torch tensors"]),
    ("bool_sum", "TypeError", ["bool", "op='max'"]),
    ("int_mean", "TypeError", ["int32", "op='sum'"]),
    ("unequal", "ValueError", ["different sizes", "[1, 2]"]),
    ("not_partition", "ValueError", ["[1] appear more than once", "[3] are in no group"]),
    ("out_of_range", "ValueError", ["[7]", "0..3"]),
    ("indivisible", "ValueError", ["(6,)", "4 equal chunks", "multiple of 4"]),
    ("a2a_scalar", "ValueError", ["scalar"]),
    ("dim", "ValueError", ["dim=3", "1 dimensions"]),
    ("src", "ValueError", ["src=4", "[0, 4)"]),
    ("pairs", "ValueError", ["[1]", "destination"]),
    ("both", "ValueError", ["axis=", "groups="]),
])
def test_local_errors_name_the_value_and_the_fix(local, case, kind, words):
    for rank, result in enumerate(local):
        got_kind, message = result[case]
        assert got_kind == kind, (rank, case, message)
        for w in words:
            assert w in message, (rank, case, w, message)
        assert result["after"] == np.float32(4)


def mismatches() -> dict:
    rank = tpudist.process_index()
    out = {}
    out["shape"] = _error(lambda: tpudist.all_reduce(np.ones((4, 5 + rank), np.float32)))
    out["dtype"] = _error(lambda: tpudist.all_gather(np.ones(3, np.float32 if rank == 0 else np.int32)))
    out["op"] = _error(lambda: tpudist.all_reduce(np.ones(3, np.float32), op="sum" if rank == 0 else "max"))
    out["count"] = _error(lambda: tpudist.all_reduce([np.ones(2, np.float32)] * (1 + rank)))
    out["agree_after"] = tpudist.all_reduce(np.float32(rank + 1))
    # Signatures both ranks have already compiled: the disagreement is found on every call, not only
    # on a signature's first one (before: float bits read as ints, or gloo aborting the process).
    f32, i32, square = np.ones(4, np.float32), np.ones(4, np.int32), np.ones((2, 2), np.float32)
    for v in (f32, i32, square):
        tpudist.all_reduce(v)
    out["cached_dtype"] = _error(lambda: tpudist.all_reduce(f32 if rank == 0 else i32))
    out["cached_shape"] = _error(lambda: tpudist.all_reduce(f32 if rank == 0 else square))
    # Rank 0's signature is cached, rank 1's is new (before: both waited out the whole timeout).
    start = time.monotonic()
    out["new_on_one"] = _error(lambda: tpudist.all_reduce(f32 if rank == 0 else np.ones(4, np.float64)))
    out["new_on_one_seconds"] = time.monotonic() - start
    # A value small enough to ride beside the header against one that runs after it.
    out["small_vs_large"] = _error(lambda: tpudist.all_reduce(np.ones(4 if rank == 0 else 5000, np.float32)))
    # Both values past the payload, of other sizes: every exchange of data is skipped (an unequal
    # message would abort gloo); a 4-step reduce_scatter the same way.
    out["large_shapes"] = _error(lambda: tpudist.all_reduce(np.ones(5000 + 1000 * rank, np.float32)))
    out["large_scatter"] = _error(lambda: tpudist.reduce_scatter(np.ones(4000 + 2000 * rank, np.float32)))
    out["keys"] = _error(lambda: tpudist.all_reduce({"a": f32, "b" if rank == 0 else "c": f32}))
    out["broadcast_keys"] = _error(lambda: tpudist.broadcast({"a": f32, "b" if rank == 0 else "c": f32}))
    # Replica-group layouts that differ, each new to its process (before: every rank waited ~30 s
    # in XLA's connection to peers that never came, then a timeout quoting the 6 s deadline).
    start = time.monotonic()
    out["groups"] = _error(lambda: tpudist.all_gather(f32, groups=[[0], [1]] if rank == 0 else [[1, 0]]))
    out["groups_seconds"] = time.monotonic() - start
    out["agree_after_cached"] = tpudist.all_reduce(np.float32(rank + 1))
    # A peer that never arrives: rank 1 skips this collective; rank 0's error names it.
    start = time.monotonic()
    if rank == 0:
        out["missing"] = _error(lambda: tpudist.all_gather(np.ones(7, np.float32)))
    out["missing_seconds"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def mismatch() -> list[dict]:
    return run_on_mesh(mismatches, nprocs=2, cpu_devices=1, timeout=300, env={"TPUDIST_COLLECTIVE_TIMEOUT": "6"})


@pytest.mark.parametrize("case, words", [
    ("groups", ["all_gather", "groups", "(0,), (1,)", "(1, 0)"]),
    ("shape", ["all_reduce", "shapes", "(4, 5)", "(4, 6)"]),
    ("dtype", ["all_gather", "dtypes", "float32", "int32"]),
    ("op", ["all_reduce", "op", "'sum'", "'max'"]),
    ("count", ["number of values", "1", "2"]),
    ("cached_dtype", ["all_reduce", "dtypes", "float32", "int32"]),
    ("cached_shape", ["all_reduce", "shapes", "(4,)", "(2, 2)"]),
    ("new_on_one", ["all_reduce", "dtypes", "float32", "float64"]),
    ("small_vs_large", ["all_reduce", "shapes", "(4,)", "(5000,)"]),
    ("large_shapes", ["all_reduce", "shapes", "(5000,)", "(6000,)"]),
    ("large_scatter", ["reduce_scatter", "shapes", "(4000,)", "(6000,)"]),
    ("keys", ["all_reduce", "structure", "'a'", "'b'", "'c'"]),
    ("broadcast_keys", ["broadcast", "structure", "'b'", "'c'"]),
])
def test_peers_disagreeing_is_an_error_on_every_rank(mismatch, case, words):
    for rank, result in enumerate(mismatch):
        kind, message = result[case]
        assert kind == "CollectiveError", (rank, message)
        assert f"rank {rank} on" in message and f"rank {1 - rank}'s" in message, message
        for w in words:
            assert w in message, (rank, w, message)
        assert result["agree_after"] == np.float32(3) and result["agree_after_cached"] == np.float32(3)


def test_a_signature_new_to_one_rank_disagrees_at_once(mismatch):
    for result in mismatch:
        assert result["new_on_one_seconds"] < 6, result["new_on_one"]  # the collective timeout is 6 s
        assert result["groups_seconds"] < 6, result["groups"]


def groups_after_a_layout_used_before() -> tuple:
    rank = tpudist.process_index()
    x = np.ones(4, np.float32)
    tpudist.all_gather(x, groups=[[0, 1]])
    tpudist.all_gather(x, groups=[[1, 0]])  # both layouts known to both ranks: no agreement on them
    start = time.monotonic()
    error = _error(lambda: tpudist.all_gather(x, groups=[[0, 1]] if rank == 0 else [[1, 0]]))
    return error, time.monotonic() - start


def test_replica_groups_that_differ_are_named_within_the_timeout_and_the_wait_quoted():
    # Both layouts are known to both processes, so each runs its own executable: XLA waits for
    # peers that are in another one. The error names both layouts, and quotes the time waited.
    results = run_on_mesh(groups_after_a_layout_used_before, nprocs=2, cpu_devices=1, timeout=300,
                          env={"TPUDIST_COLLECTIVE_TIMEOUT": "5"})
    for rank, ((kind, message), seconds) in enumerate(results):
        assert kind == "CollectiveError", message
        waited = float(re.search(r"timed out after ([\d.]+)s", message).group(1))
        assert 5 <= waited <= seconds, (waited, seconds, message)  # it quotes the time it waited
        mine, theirs = ("(0, 1)", "(1, 0)") if rank == 0 else ("(1, 0)", "(0, 1)")
        assert f"groups {mine} differ from rank {1 - rank}'s {theirs}" in message, message
        assert seconds < 45, (seconds, message)


def test_missing_peer_times_out_naming_the_rank(mismatch):
    kind, message = mismatch[0]["missing"]
    assert kind == "CollectiveTimeout", message
    assert "ranks [1] did not arrive" in message and "TPUDIST_COLLECTIVE_TIMEOUT" in message
    assert 6 <= mismatch[0]["missing_seconds"] < 30


def cached_then_missing(collective: str, done: str) -> tuple | None:
    x = np.ones(4, np.float32)
    call = {"all_reduce": tpudist.all_reduce, "reduce_scatter": tpudist.reduce_scatter,
            "all_gather": tpudist.all_gather}[collective]
    call(x)  # compiled and checked once; the next call runs without the check
    if tpudist.process_index() == 1:
        # alive but never calling until rank 0 is done: it must time out, not see a closed socket
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    try:
        start = time.monotonic()
        timed_out = _error(lambda: call(x))
        seconds = time.monotonic() - start
        return timed_out, seconds, _error(lambda: call(x))
    finally:
        open(done, "w").close()


# reduce_scatter: gloo's own reduce-scatter ignores the collective timeout (jax#40831).
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_missing_peer_on_a_cached_collective_times_out_and_later_calls_refuse(collective, tmp_path):
    (kind, message), seconds, (after_kind, after) = run_on_mesh(
        cached_then_missing, nprocs=2, kwargs={"collective": collective, "done": str(tmp_path / "done")},
        timeout=300,
        env={"TPUDIST_COLLECTIVE_TIMEOUT": "5"})[0]
    assert kind == "CollectiveTimeout", message
    assert f"{collective} (collective #2) timed out after " in message and "ranks [1] did not arrive" in message
    waited = float(re.search(r"timed out after ([\d.]+)s", message).group(1))
    assert 5 <= waited <= seconds, (waited, seconds, message)  # the time it quotes is the time it waited
    assert 5 <= seconds < 15
    assert after_kind == "CollectiveError" and "restart the job" in after
