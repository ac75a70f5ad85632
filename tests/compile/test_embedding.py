"""ShardedEmbedding across 2 processes x 2 devices: lookups and gradients equal a dense numpy reference on
2x2, 4x1 and 1x4 meshes, for every lookup algorithm and combiner, with ids at shard edges, repeated ids
and padding; the gradient keeps the table's row sharding and no device holds the whole table."""

from __future__ import annotations

import numpy as np
import pytest

import tpudist

FEATURES = 3
BATCH = 8
BAG = 3
SINGLE = 13  # rows of the one-table case: 2 shards of 7 (1 padding row), 4 shards of 4 (3 padding rows)
MULTI = (11, 6, 9)

# (mesh axes, algorithm, tables, combiner): every algorithm on the 2x2 mesh, bags on the 1x4 mesh
# where shards are small, and the degenerate single-shard axis (4x1).
CASES = (
    [({"data": 2, "model": 2}, "psum", SINGLE, None),
     ({"data": 2, "model": 2}, "psum", MULTI, "mean"),
     ({"data": 2, "model": 2}, "psum_scatter", MULTI, None),
     ({"data": 2, "model": 2}, "all_to_all", MULTI, "mean")]
    + [({"data": 1, "model": 4}, "psum", MULTI, "sum"),
       ({"data": 1, "model": 4}, "all_to_all", MULTI, "sum"),
       ({"data": 1, "model": 4}, "auto", SINGLE, "mean"),  # auto -> psum_scatter on 4 devices
       ({"data": 4, "model": 1}, "auto", MULTI, None)]
)


def _sizes(tables):
    return [tables] if isinstance(tables, int) else list(tables)


def _dense_tables(tables):
    rng = np.random.default_rng(11)
    return [rng.normal(size=(n, FEATURES)).astype(np.float32) for n in _sizes(tables)]


def _ids(tables, combiner, shards):
    """Ids hitting the first and last row of every shard, repeats, and (in bags) -1 padding."""
    rng = np.random.default_rng(5)
    columns = []
    for n in _sizes(tables):
        rows = -(-n // shards)
        edges = sorted({min(n - 1, i) for m in range(shards) for i in (m * rows, m * rows + rows - 1)})
        shape = (BATCH, BAG) if combiner else (BATCH,)
        ids = rng.integers(0, n, size=shape)
        flat = ids.reshape(-1)
        flat[: len(edges)] = edges  # every shard edge appears
        flat[len(edges): len(edges) + 3] = edges[-1]  # a repeated id (the last row of the table)
        if combiner:
            ids[1, 1:] = -1  # a ragged bag: one real id, two padding slots
            ids[2, :] = ids[2, 0]  # the same id three times in one bag
        columns.append(ids)
    if isinstance(tables, int):
        return columns[0].astype(np.int32)
    return np.stack(columns, axis=1).astype(np.int32)  # (B, T) or (B, T, L)


def _weights(tables, combiner):
    shape = (BATCH,) + (() if isinstance(tables, int) else (len(tables),)) + (FEATURES,)
    return np.random.default_rng(9).normal(size=shape).astype(np.float32)


def _reference(dense, ids, weights, combiner, single):
    """numpy: out = combine(table[ids]); grad of sum(out * weights) w.r.t. each table."""
    ids = ids.reshape(BATCH, len(dense), -1)
    weights = weights.reshape(BATCH, len(dense), FEATURES)
    out = np.zeros((BATCH, len(dense), FEATURES), np.float32)
    grads = [np.zeros_like(t) for t in dense]
    for b in range(BATCH):
        for t, table in enumerate(dense):
            valid = [i for i in ids[b, t] if 0 <= i < table.shape[0]]
            scale = 1.0 / len(valid) if combiner == "mean" and valid else 1.0
            for i in valid:
                out[b, t] += table[i] * scale
                grads[t][i] += weights[b, t] * scale
    return (out[:, 0] if single else out), grads


def _run_cases(index: int):
    import jax
    from jax.experimental import multihost_utils
    results = []
    for axes, algorithm, tables, combiner in CASES:
        mesh = tpudist.mesh.make_mesh(axes)
        emb = tpudist.ShardedEmbedding(tables, FEATURES, mesh=mesh, axis="model",
                                       combiner=combiner, algorithm=algorithm)
        dense = _dense_tables(tables)
        table = emb.shard(dense[0] if isinstance(tables, int) else dense)
        ids = _ids(tables, combiner, mesh.shape["model"])
        weights = _weights(tables, combiner)

        def loss(t, i, w):
            out = emb(t, i)
            return (out * w).sum(), out

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(table, ids, weights)
        results.append({
            "out": np.asarray(multihost_utils.process_allgather(out, tiled=True)),
            "grads": emb.unshard(grad),
            "grad_sharding_is_table_sharding": grad.sharding.is_equivalent_to(table.sharding, 2),
            "grad_shard_shapes": sorted({s.data.shape for s in grad.addressable_shards}),
            "block_shape": (emb.layout.block_rows, FEATURES),
            "plan": emb.plan(BATCH),
        })
    return results


def _everything(index: int):
    return {"cases": _run_cases(index), "misc": _init_memory_errors(index)}


@pytest.fixture(scope="module")
def results():
    """One 2-process x 2-device job runs every check; the tests below read its results."""
    return tpudist.spawn(_everything, nprocs=2, cpu_devices=2, timeout=240)


@pytest.fixture(scope="module")
def case_results(results):
    return [r["cases"] for r in results]


@pytest.fixture(scope="module")
def misc_results(results):
    return [r["misc"] for r in results]


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{'x'.join(str(v) for v in a.values())}-{al}-{'one' if isinstance(t, int) else 'many'}"
                              f"-{c}" for a, al, t, c in CASES])
def test_lookup_and_gradient_equal_dense_reference(case_results, case):
    axes, algorithm, tables, combiner = CASES[case]
    single = isinstance(tables, int)
    dense = _dense_tables(tables)
    ids = _ids(tables, combiner, axes["model"])
    expected_out, expected_grads = _reference(dense, ids, _weights(tables, combiner), combiner, single)
    for rank in (0, 1):
        r = case_results[rank][case]
        np.testing.assert_allclose(r["out"], expected_out, rtol=1e-5, atol=1e-6)
        grads = [r["grads"]] if single else r["grads"]
        for got, want in zip(grads, expected_grads):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert r["grad_sharding_is_table_sharding"]
        # Every device holds one block of the gradient: the table's rows / axis size, never all of it.
        assert r["grad_shard_shapes"] == [r["block_shape"]]
        # The batch splits over every axis of size > 1 when the algorithm needs per-device ids.
        split = tuple(a for a in ("data", "model") if axes[a] > 1)
        if algorithm == "psum" or axes["model"] == 1:
            assert r["plan"] == ("psum", tuple(a for a in split if a != "model"))
        else:
            assert r["plan"] == ("psum_scatter" if algorithm == "auto" else algorithm, split)


# -- init, memory, errors ----------------------------------------------------------------------------

def _init_memory_errors(index: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    inits = {}
    for axes in ({"data": 2, "model": 2}, {"data": 1, "model": 4}, {"data": 4, "model": 1}):
        mesh = tpudist.mesh.make_mesh(axes)
        emb = tpudist.ShardedEmbedding(list(MULTI), FEATURES, mesh=mesh)
        table = emb.init(jax.random.key(0))
        inits[axes["model"]] = {"tables": emb.unshard(table),
                                "stacked": np.asarray(multihost_utils.process_allgather(table, tiled=True)),
                                "layout": (emb.layout.shard_rows, emb.layout.offsets)}

    # A table 64x larger than the batch: what one device needs for the lookup and the gradient.
    mesh = tpudist.mesh.make_mesh({"data": 1, "model": 4})
    emb = tpudist.ShardedEmbedding(8192, 16, mesh=mesh)
    table = emb.init(jax.random.key(1))
    ids = np.arange(128, dtype=np.int32) * 61 % 8192
    values = emb.unshard(table)
    big_init = {"mean": float(values.mean()), "std": float(values.std()),
                "bound": float(np.abs(values).max()), "unique": int(np.unique(values).size)}
    grad_fn = jax.jit(jax.grad(lambda t, i: emb(t, i).sum()))
    memory = grad_fn.lower(table, ids).compile().memory_analysis()
    per_device = None if memory is None else (memory.temp_size_in_bytes + memory.output_size_in_bytes)

    errors = {}
    for name, call in {
        "float_ids": lambda: emb(table, jnp.zeros(4)),
        "table_shape": lambda: emb(jnp.zeros((10, 16)), ids),
        "axis": lambda: tpudist.ShardedEmbedding(10, 4, mesh=mesh, axis="rows"),
        "combiner": lambda: tpudist.ShardedEmbedding(10, 4, mesh=mesh, combiner="max"),
        "tables_column": lambda: tpudist.ShardedEmbedding([5, 6], 4, mesh=mesh)(
            tpudist.ShardedEmbedding([5, 6], 4, mesh=mesh).init(jax.random.key(0)), np.zeros((4, 3), np.int32)),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return {"inits": inits, "big_init": big_init, "per_device_bytes": per_device, "table_bytes": 8192 * 16 * 4,
            "errors": errors}


def test_init_values_do_not_depend_on_the_mesh_and_padding_is_zero(misc_results):
    inits = misc_results[0]["inits"]
    for shards, got in inits.items():
        for t, n in enumerate(MULTI):
            np.testing.assert_array_equal(got["tables"][t], inits[1]["tables"][t])
            assert got["tables"][t].shape == (n, FEATURES)
            assert np.abs(got["tables"][t]).max() <= 1 / np.sqrt(n)
            assert np.unique(got["tables"][t], axis=0).shape[0] == n  # every row drawn on its own
        shard_rows, offsets = got["layout"]
        blocks = got["stacked"].reshape(shards, sum(shard_rows), FEATURES)
        for n, rows, off in zip(MULTI, shard_rows, offsets):
            padded = blocks[:, off:off + rows].reshape(-1, FEATURES)[n:]
            np.testing.assert_array_equal(padded, 0)
    # 131072 draws of uniform(-b, b) with b = 1/sqrt(8192): mean ~ 0, std ~ b/sqrt(3), no repeats.
    big, bound = misc_results[0]["big_init"], 1 / np.sqrt(8192)
    assert abs(big["mean"]) < 0.01 * bound
    assert abs(big["std"] - bound / np.sqrt(3)) < 0.01 * bound
    assert big["bound"] <= bound and big["unique"] > 0.99 * 8192 * 16
    for r in misc_results:  # every process sees the same table
        for t in range(len(MULTI)):
            np.testing.assert_array_equal(r["inits"][2]["tables"][t], inits[2]["tables"][t])


def test_no_device_materialises_the_table_or_its_gradient(misc_results):
    r = misc_results[0]
    assert r["per_device_bytes"] is not None, "XLA gave no memory analysis on this backend"
    # The gradient block (table / 4) plus batch-sized temporaries; a full-table buffer would not fit.
    assert r["per_device_bytes"] < 0.6 * r["table_bytes"], r["per_device_bytes"]


def test_user_errors_name_the_value_and_the_fix(misc_results):
    e = misc_results[0]["errors"]
    assert e["float_ids"].startswith("TypeError: ids must be integers")
    assert "table has shape (10, 16), expected (8192, 16)" in e["table_shape"]
    assert "emb.init(key)" in e["table_shape"]
    assert "mesh has no axis 'rows'" in e["axis"] and "['data', 'model']" in e["axis"]
    assert "combiner must be one of" in e["combiner"] and "'max'" in e["combiner"]
    assert "T=2 tables" in e["tables_column"]
