"""Every collective x op x dtype x input kind x groups against numpy, on a 4-process CPU mesh.

All cases run in ONE 4-process job (a module fixture); each test then compares its slice of the
results with a reference computed in this process from every rank's inputs. Inputs are
deterministic functions of (rank, case), so the reference sees exactly what each rank sent.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tpudist
from tpudist.testing import run_on_mesh

N = 4
GROUPINGS = {"all": None, "pairs": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (1,), (7,), (3, 5), (13,)]
KINDS = ["numpy", "torch", "jax"]
BIG = 1 << 20  # elements: 4 MiB of float32

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
          "uint8": torch.uint8, "bool": torch.bool}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)


def value(rank: int, case: int, dtype: str, shape: tuple, op: str = "sum") -> np.ndarray:
    """Rank's deterministic input; small integers so sums and products are exact in every dtype."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    low, high = (1, 3) if op == "prod" else (0, 20 if dtype not in ("int8", "uint8") else 10)
    if dtype.startswith(("float", "bfloat")):
        base = rng.integers(low * 4, high * 4, size=shape) / 4.0  # exact in every float dtype
        return base.astype(np_dtype(dtype))
    return rng.integers(low, high, size=shape).astype(np_dtype(dtype))


def as_kind(a: np.ndarray, kind: str):
    if kind == "torch":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) if a.dtype == np_dtype("bfloat16") \
            else torch.from_numpy(np.ascontiguousarray(a))
    if kind == "jax":
        return jnp.asarray(a)
    return a


def to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy().astype(np_dtype("bfloat16")) if x.dtype == torch.bfloat16 else x.numpy()
    return np.asarray(x)


def reduce_cases():
    cases = []
    for op in ("sum", "mean", "max", "min", "prod"):
        dtypes = [d for d in DTYPES if not (d == "bool" and op not in ("max", "min"))
                  and not (op == "mean" and not d.startswith(("float", "bfloat")))]
        leaves = [(d, s, KINDS[i % 3]) for i, (d, s) in enumerate((d, s) for d in dtypes for s in SHAPES)]
        for g in GROUPINGS:
            cases.append((op, g, leaves))
    return cases


REDUCE_CASES = reduce_cases()
MOVE_DTYPES = ["float32", "bfloat16", "int64", "uint8", "bool", "float64"]


def scenario() -> dict:
    """Runs on every rank: every collective case, results keyed by case name, as numpy."""
    rank = tpudist.process_index()
    out: dict = {}
    for ci, (op, g, leaves) in enumerate(REDUCE_CASES):
        xs = [as_kind(value(rank, ci * 100 + li, d, s, op), k) for li, (d, s, k) in enumerate(leaves)]
        res = tpudist.all_reduce(xs, op=op, groups=GROUPINGS[g])
        assert len(res) == len(xs)
        for li, (x, r) in enumerate(zip(xs, res)):
            assert type(r) is type(x), (op, g, li, type(x), type(r))
            assert to_numpy(r).dtype == to_numpy(x).dtype and to_numpy(r).shape == to_numpy(x).shape
        out[("all_reduce", op, g)] = [to_numpy(r) for r in res]
    for g in GROUPINGS:
        for dim in (0, 1, -1):
            xs = [as_kind(value(rank, 5000 + i, d, (3, 2)), KINDS[i % 3]) for i, d in enumerate(MOVE_DTYPES)]
            out[("all_gather", dim, g)] = [to_numpy(r) for r in tpudist.all_gather(xs, dim=dim, groups=GROUPINGS[g])]
        xs0 = [np.float32(rank + 0.5), np.array(rank, np.int64)]
        out[("all_gather_0d", g)] = [to_numpy(r) for r in tpudist.all_gather(xs0, groups=GROUPINGS[g])]
        for op in ("sum", "mean", "max", "min", "prod"):
            dts = ["float32", "bfloat16", "int32"] if op != "mean" else ["float32", "bfloat16", "float64"]
            xs = [as_kind(value(rank, 6000 + i, d, (8, 3), op), KINDS[i % 3]) for i, d in enumerate(dts)]
            res = tpudist.reduce_scatter(xs, op=op, dim=0, groups=GROUPINGS[g])
            out[("reduce_scatter", op, g)] = [to_numpy(r) for r in res]
        x = as_kind(value(rank, 6500, "float32", (2, 12)), "torch")
        out[("reduce_scatter_dim1", g)] = to_numpy(tpudist.reduce_scatter(x, dim=1, groups=GROUPINGS[g]))
        for split, concat in ((0, 0), (1, 0), (0, 1)):
            xs = [as_kind(value(rank, 7000 + i, d, (4, 4)), KINDS[i % 3]) for i, d in enumerate(MOVE_DTYPES)]
            res = tpudist.all_to_all(xs, split_dim=split, concat_dim=concat, groups=GROUPINGS[g])
            out[("all_to_all", split, concat, g)] = [to_numpy(r) for r in res]
        srcs = (0, 3) if g == "all" else (1,)
        for src in srcs:
            xs = [as_kind(value(rank, 8000 + i, d, s), KINDS[i % 3])
                  for i, (d, s) in enumerate((d, s) for d in MOVE_DTYPES for s in ((), (5,)))]
            out[("broadcast", src, g)] = [to_numpy(r) for r in tpudist.broadcast(xs, src=src, groups=GROUPINGS[g])]
    special = np.array([-0.0, np.nan, np.inf], np.float32) if rank == 2 else np.zeros(3, np.float32)
    out["broadcast_bits"] = tpudist.broadcast(special, src=2).view(np.uint32)
    ring = [[r, (r + 1) % N] for r in range(N)]
    out["permute_ring"] = to_numpy(tpudist.collective_permute(torch.tensor([rank, 10 * rank]), ring))
    out["permute_partial"] = tpudist.collective_permute(np.full(3, rank + 1.5, np.float32), [[0, 3], [3, 1]])
    # Several MiB: reduce_scatter with 4 MiB chunks is where gloo's psum_scatter went wrong (jax#40830).
    big = value(rank, 9000, "float32", (N * BIG,))
    out["big_reduce_scatter"] = tpudist.reduce_scatter(big)
    out["big_all_reduce"] = to_numpy(tpudist.all_reduce(torch.from_numpy(big[:BIG * 2 + 3].copy())))
    # 128-256 KiB per process: gathered with one all-to-all on a 4-process CPU mesh (_ops._exchange)
    out["mid_gather"] = to_numpy(tpudist.all_gather(torch.from_numpy(value(rank, 9100, "float32", (40009,)))))
    out["mid_gather_dim1"] = tpudist.all_gather(value(rank, 9101, "float32", (7, 5003)), dim=1)
    out["mid_gather_bool"] = tpudist.all_gather(value(rank, 9102, "bool", (150001,)))
    # Structures and scalars keep their shape and Python types.
    tree = {"a": [1, 2.5, True], "b": (np.float32(rank),), "c": {"d": torch.ones(2) * rank}}
    out["tree"] = tpudist.all_reduce(tree, op="max")
    out["empty"] = [to_numpy(r) for r in tpudist.all_reduce([np.zeros((0,), np.float32), torch.zeros(0, 3)])]
    out["empty_gather"] = tpudist.all_gather(np.zeros((0, 2), np.int32))
    out["scaled"] = tpudist.all_reduce(np.float32(rank), scale=0.5)
    # Inexact float sums: every rank of a group must end with the same bits (recursive doubling
    # combines the same two operands on both sides of each exchange), whatever the algorithm.
    noisy = np.random.default_rng(rank).standard_normal(1001).astype(np.float32)
    out["inexact_sum"] = {g: tpudist.all_reduce(noisy, groups=GROUPINGS[g]) for g in GROUPINGS}
    out["inexact_bf16_mean"] = to_numpy(tpudist.all_reduce(torch.from_numpy(noisy[:37]).to(torch.bfloat16), op="mean"))
    # Small values run from the engine's reused staging buffers: a result must survive the next
    # call of the same signature, the input must stay as it was, and strided tensors must work.
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
    first = tpudist.all_reduce(base)
    second = tpudist.all_reduce(base * 10)
    first += 0.5  # results are the caller's own, writable tensors
    strided = (torch.arange(6, dtype=torch.float32).reshape(3, 2) * (rank + 1)).t()
    out["staged"] = {"first": to_numpy(first), "second": to_numpy(second), "input": to_numpy(base),
                     "strided": to_numpy(tpudist.all_reduce(strided)),
                     "bf16_twice": [to_numpy(tpudist.all_reduce(torch.full((3,), float(rank + k), dtype=torch.bfloat16)))
                                    for k in (1, 2)]}
    # Values past the staging limit come back through DLPack: a result must survive the next call
    # of the same signature, also where the result is the value itself (groups of one).
    medium = torch.arange(1 << 16, dtype=torch.float32) + rank  # 256 KiB
    singles = [[r] for r in range(N)]
    results = [tpudist.all_reduce(medium), tpudist.all_reduce(medium * 2),
               tpudist.all_reduce(medium, groups=singles), tpudist.all_reduce(medium * 3, groups=singles),
               tpudist.all_reduce(np.full(5, rank, np.int32), groups=singles),
               tpudist.all_reduce(np.full(5, rank * 7, np.int32), groups=singles)]
    out["medium"] = {"results": [to_numpy(r) for r in results], "input": to_numpy(medium)}
    # A repeated call compiles nothing new, whatever the input's kind, below and past the staging
    # limit; a call differing in op, groups, dtype or shape compiles its own executable. The shapes
    # (3, 7), (2, 7) and (20000,) appear nowhere else in this scenario.
    x = np.full((3, 7), rank, np.float32)
    counts = [tpudist.collective_stats()]
    same = [tpudist.all_reduce(x * k) for k in (1, 2, 3)] + [tpudist.all_reduce(torch.from_numpy(x * 4))]
    counts.append(tpudist.collective_stats())
    changed = [tpudist.all_reduce(x, op="max"), tpudist.all_reduce(x, groups=GROUPINGS["pairs"]),
               tpudist.all_reduce(x.astype(np.float64)), tpudist.all_reduce(x[:2])]
    counts.append(tpudist.collective_stats())
    past_staging = [tpudist.all_reduce(np.full(20000, rank * k, np.float32)) for k in (1, 2)]
    counts.append(tpudist.collective_stats())
    out["compiles"] = {"same": [to_numpy(r) for r in same], "changed": [to_numpy(r) for r in changed],
                       "past_staging": past_staging, "counts": counts}
    # Repeats of a small call (same kind, dtype, shape, parameters, groups) give the full path's
    # results; changing any of them is never served by another call's repeat.
    grad = torch.full((2,), float(rank), requires_grad=True)
    out["repeat"] = {
        "numpy": [tpudist.all_reduce(np.full(4, rank * k, np.int32), op="max") for k in (1, 2, 3)],
        "scalar": [tpudist.all_reduce(float(rank) * k) for k in (1, 2, 3)],
        "grad": [to_numpy(tpudist.all_reduce(grad * k)) for k in (1, 2)] + [to_numpy(tpudist.all_reduce(grad))],
        "groups": [to_numpy(tpudist.all_reduce(torch.ones(2) * (rank + k), groups=GROUPINGS[g]))
                   for k, g in enumerate(("pairs", "all", "pairs", "strided"))],
        "op": [to_numpy(tpudist.all_reduce(torch.ones(2) * (rank + 1), op=op)) for op in ("sum", "prod", "sum")],
        "gather": [to_numpy(tpudist.all_gather(torch.tensor([rank * k]))) for k in (1, 2)],
        "kinds": [to_numpy(tpudist.all_reduce(v)) for v in (np.float32(rank), np.array(rank, np.float32),
                                                           torch.tensor(float(rank)), np.float32(rank + 1))],
    }
    try:  # same dtype and shape as a value with a repeat path, but sparse: still refused
        tpudist.all_reduce(torch.ones(2).to_sparse())
        out["repeat"]["sparse"] = "accepted"
    except TypeError as e:
        out["repeat"]["sparse"] = str(e)
    from tpudist.collectives._ops import _exchange
    out["exchanges"] = {(kind, size, n): _exchange(kind, jnp.zeros(n, jnp.float32), size)
                        for kind in ("all_reduce", "all_gather") for size in (1, 2, 3, 4)
                        for n in (1, 3, 1024, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 23)}
    tpudist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_mesh(scenario, nprocs=N, cpu_devices=1, timeout=600)


def ref_groups(g: str) -> list[list[int]]:
    return GROUPINGS[g] or [list(range(N))]


def group_of(rank: int, g: str) -> list[int]:
    return next(grp for grp in ref_groups(g) if rank in grp)


def reduce_np(stack: np.ndarray, op: str, dtype: np.dtype) -> np.ndarray:
    wide = stack.astype(np.float64) if dtype.kind == "f" or dtype == np_dtype("bfloat16") else stack
    fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    return fn(wide, axis=0).astype(dtype)


@pytest.mark.parametrize("case", range(len(REDUCE_CASES)),
                         ids=[f"{op}-{g}" for op, g, _ in REDUCE_CASES])
def test_all_reduce_matches_numpy(results, case):
    op, g, leaves = REDUCE_CASES[case]
    for rank in range(N):
        members = group_of(rank, g)
        for li, (d, s, _) in enumerate(leaves):
            stack = np.stack([value(r, case * 100 + li, d, s, op) for r in members])
            expect = reduce_np(stack, op, np_dtype(d))
            got = results[rank][("all_reduce", op, g)][li]
            np.testing.assert_array_equal(got, expect, err_msg=f"rank {rank} {op} {g} {d} {s}")


@pytest.mark.parametrize("g", GROUPINGS)
def test_all_gather_matches_numpy(results, g):
    for rank in range(N):
        members = group_of(rank, g)
        for dim in (0, 1, -1):
            for i, d in enumerate(MOVE_DTYPES):
                expect = np.concatenate([value(r, 5000 + i, d, (3, 2)) for r in members], axis=dim)
                np.testing.assert_array_equal(results[rank][("all_gather", dim, g)][i], expect)
        got = results[rank][("all_gather_0d", g)]
        np.testing.assert_array_equal(got[0], np.array([r + 0.5 for r in members], np.float32))
        np.testing.assert_array_equal(got[1], np.array(members, np.int64))


@pytest.mark.parametrize("g", GROUPINGS)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_reduce_scatter_matches_numpy(results, g, op):
    for rank in range(N):
        members = group_of(rank, g)
        pos = members.index(rank)
        dts = ["float32", "bfloat16", "int32"] if op != "mean" else ["float32", "bfloat16", "float64"]
        for i, d in enumerate(dts):
            full = reduce_np(np.stack([value(r, 6000 + i, d, (8, 3), op) for r in members]), op, np_dtype(d))
            chunk = 8 // len(members)
            np.testing.assert_array_equal(results[rank][("reduce_scatter", op, g)][i],
                                          full[pos * chunk:(pos + 1) * chunk])
        full = np.sum([value(r, 6500, "float32", (2, 12)) for r in members], axis=0)
        chunk = 12 // len(members)
        np.testing.assert_array_equal(results[rank][("reduce_scatter_dim1", g)], full[:, pos * chunk:(pos + 1) * chunk])


@pytest.mark.parametrize("g", GROUPINGS)
def test_all_to_all_matches_numpy(results, g):
    for rank in range(N):
        members = group_of(rank, g)
        pos = members.index(rank)
        for split, concat in ((0, 0), (1, 0), (0, 1)):
            for i, d in enumerate(MOVE_DTYPES):
                chunks = [np.split(value(r, 7000 + i, d, (4, 4)), len(members), axis=split)[pos] for r in members]
                np.testing.assert_array_equal(results[rank][("all_to_all", split, concat, g)][i],
                                              np.concatenate(chunks, axis=concat))


@pytest.mark.parametrize("g", GROUPINGS)
def test_broadcast_matches_numpy(results, g):
    for rank in range(N):
        members = group_of(rank, g)
        for src in ((0, 3) if g == "all" else (1,)):
            combos = [(d, s) for d in MOVE_DTYPES for s in ((), (5,))]
            for i, (d, s) in enumerate(combos):
                np.testing.assert_array_equal(results[rank][("broadcast", src, g)][i],
                                              value(members[src], 8000 + i, d, s))


def test_broadcast_is_bit_exact(results):
    expect = np.array([-0.0, np.nan, np.inf], np.float32).view(np.uint32)
    for rank in range(N):
        np.testing.assert_array_equal(results[rank]["broadcast_bits"], expect)


def test_collective_permute(results):
    for rank in range(N):
        src = (rank - 1) % N
        np.testing.assert_array_equal(results[rank]["permute_ring"], [src, 10 * src])
    expect = {3: 1.5, 1: 4.5}
    for rank in range(N):
        np.testing.assert_array_equal(results[rank]["permute_partial"], np.full(3, expect.get(rank, 0.0), np.float32))


def test_several_mib(results):
    stack = np.stack([value(r, 9000, "float32", (N * BIG,)) for r in range(N)])
    total = stack.sum(axis=0, dtype=np.float64).astype(np.float32)
    for rank in range(N):
        np.testing.assert_array_equal(results[rank]["big_reduce_scatter"], total[rank * BIG:(rank + 1) * BIG])
        np.testing.assert_array_equal(results[rank]["big_all_reduce"], total[:BIG * 2 + 3])


def test_gathers_between_the_doubling_and_ring_limits(results):
    cases = {"mid_gather": (9100, "float32", (40009,), 0), "mid_gather_dim1": (9101, "float32", (7, 5003), 1),
             "mid_gather_bool": (9102, "bool", (150001,), 0)}
    for key, (case, dtype, shape, dim) in cases.items():
        expect = np.concatenate([value(r, case, dtype, shape) for r in range(N)], axis=dim)
        for rank in range(N):
            assert results[rank][key].dtype == expect.dtype, key
            np.testing.assert_array_equal(results[rank][key], expect, err_msg=key)


def test_inexact_sums_agree_bit_for_bit_across_a_group(results):
    noisy = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in range(N)]
    for g in GROUPINGS:
        for group in ref_groups(g):
            expect = np.sum([noisy[r].astype(np.float64) for r in group], axis=0)
            first = results[group[0]]["inexact_sum"][g]
            np.testing.assert_allclose(first, expect, rtol=1e-5, atol=1e-5)
            for r in group[1:]:
                np.testing.assert_array_equal(results[r]["inexact_sum"][g].view(np.uint32), first.view(np.uint32))
    expect = np.mean([np.asarray(torch.from_numpy(n[:37]).to(torch.bfloat16).float()) for n in noisy], axis=0)
    for r in range(N):
        got = results[r]["inexact_bf16_mean"]
        np.testing.assert_allclose(got.astype(np.float32), expect, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(got.view(np.uint16), results[0]["inexact_bf16_mean"].view(np.uint16))


def test_small_values_through_reused_staging_buffers(results):
    total = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + r for r in range(N))
    strided_total = sum(np.arange(6, dtype=np.float32).reshape(3, 2).T * (r + 1) for r in range(N))
    for rank in range(N):
        staged = results[rank]["staged"]
        np.testing.assert_array_equal(staged["first"], total + 0.5)
        np.testing.assert_array_equal(staged["second"], total * 10)
        np.testing.assert_array_equal(staged["input"], np.arange(6, dtype=np.float32).reshape(2, 3) + rank)
        np.testing.assert_array_equal(staged["strided"], strided_total)
        for k, got in zip((1, 2), staged["bf16_twice"]):  # bfloat16 takes the unstaged path
            np.testing.assert_array_equal(got.astype(np.float32), np.full(3, sum(r + k for r in range(N)), np.float32))


def test_staged_results_are_the_callers_own(results):
    base = np.arange(1 << 16, dtype=np.float32)
    total = sum(base + r for r in range(N))
    for rank in range(N):
        got = results[rank]["medium"]["results"]
        for res, want in zip(got, (total, total * 2, base + rank, (base + rank) * 3,
                                   np.full(5, rank, np.int32), np.full(5, rank * 7, np.int32))):
            np.testing.assert_array_equal(res, want)
        np.testing.assert_array_equal(results[rank]["medium"]["input"], base + rank)


def test_repeated_small_calls(results):
    """The repeat path gives the full path's results: values change between calls, the result
    keeps the input's kind, and a call differing in groups or op is not served by another's path."""
    for rank in range(N):
        rep = results[rank]["repeat"]
        for k, got in zip((1, 2, 3), rep["numpy"]):
            assert type(got) is np.ndarray and got.dtype == np.int32
            np.testing.assert_array_equal(got, np.full(4, (N - 1) * k, np.int32))
        assert rep["scalar"] == [float(sum(range(N)) * k) for k in (1, 2, 3)]
        assert all(type(v) is float for v in rep["scalar"])
        for k, got in zip((1, 2, 1), rep["grad"]):
            np.testing.assert_array_equal(got, np.full(2, sum(range(N)) * k, np.float32))
        for k, (got, g) in enumerate(zip(rep["groups"], ("pairs", "all", "pairs", "strided"))):
            members = group_of(rank, g)
            np.testing.assert_array_equal(got, np.full(2, sum(r + k for r in members), np.float32))
        for op, got in zip(("sum", "prod", "sum"), rep["op"]):
            want = np.prod(np.arange(1, N + 1)) if op == "prod" else sum(range(1, N + 1))
            np.testing.assert_array_equal(got, np.full(2, want, np.float32))
        for k, got in zip((1, 2), rep["gather"]):
            np.testing.assert_array_equal(got, np.arange(N) * k)
        # the same float32 () signature through a numpy scalar, a 0-d array and a tensor
        for k, got in zip((0, 0, 0, 1), rep["kinds"]):
            np.testing.assert_array_equal(got, np.float32(sum(range(N)) + N * k))
        assert "dense" in rep["sparse"]


def test_repeated_calls_do_not_recompile(results):
    x = np.full((3, 7), 1, np.float32) * sum(range(N))
    pairs = {rank: sum(group_of(rank, "pairs")) for rank in range(N)}
    for rank in range(N):
        got = results[rank]["compiles"]
        for k, res in zip((1, 2, 3, 4), got["same"]):
            np.testing.assert_array_equal(res, x * k)
        for res, want in zip(got["changed"], (np.full((3, 7), N - 1, np.float32), np.full((3, 7), pairs[rank], np.float32),
                                              x.astype(np.float64), x[:2])):
            assert res.dtype == want.dtype
            np.testing.assert_array_equal(res, want)
        for k, res in zip((1, 2), got["past_staging"]):
            np.testing.assert_array_equal(res, np.full(20000, sum(range(N)) * k, np.float32))
        first, repeated, changed, past = got["counts"]
        assert (repeated.compiles - first.compiles, repeated.calls - first.calls) == (1, 4)
        assert (changed.compiles - repeated.compiles, changed.calls - repeated.calls) == (4, 4)
        assert (past.compiles - changed.compiles, past.calls - changed.calls) == (1, 2)
        assert past.compile_seconds > first.compile_seconds


def test_exchange_choice(results):
    """Recursive doubling for power-of-two groups up to the size limits (float32 values of n
    elements), then an all-to-all for all-gathers over more than 2 processes up to 256 KiB; XLA's
    own collectives otherwise, and for all-reduces of fewer elements than processes."""
    doubling = {("all_reduce", 2, n) for n in (3, 1024, 1 << 16, 1 << 18, 1 << 20)}  # up to 4 MiB
    doubling |= {("all_reduce", 4, n) for n in (1024, 1 << 16, 1 << 18)}                     # up to 1 MiB
    doubling |= {("all_gather", 2, n) for n in (1, 3, 1024, 1 << 16, 1 << 18)}                  # up to 1 MiB
    doubling |= {("all_gather", 4, n) for n in (1, 3, 1024)}                                    # up to 128 KiB
    all_to_all = {("all_gather", 4, 1 << 16)}                                                  # up to 256 KiB
    choices = results[0]["exchanges"]
    assert {key for key, choice in choices.items() if choice == "doubling"} == doubling
    assert {key for key, choice in choices.items() if choice == "all_to_all"} == all_to_all
    assert {key for key, choice in choices.items() if choice == "native"} == set(choices) - doubling - all_to_all


def test_structure_kinds_and_scalars(results):
    for rank in range(N):
        tree = results[rank]["tree"]
        assert tree["a"] == [1, 2.5, True] and [type(v) for v in tree["a"]] == [int, float, bool]
        assert isinstance(tree["b"], tuple) and tree["b"][0] == np.float32(N - 1)
        assert type(tree["b"][0]) is np.float32
        assert isinstance(tree["c"]["d"], torch.Tensor)
        assert torch.equal(tree["c"]["d"], torch.full((2,), float(N - 1)))
        assert [e.shape for e in results[rank]["empty"]] == [(0,), (0, 3)]
        assert results[rank]["empty_gather"].shape == (0, 2)
        assert results[rank]["scaled"] == np.float32(sum(range(N)) * 0.5)
