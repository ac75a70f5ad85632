"""tpudist.compile for JAX functions: a 2-process step follows the 1-device reference, compiles once,
assembles each process's local batch, runs per-device code with in-graph collectives, and uses the
persistent compilation cache. Every multi-process check runs in real processes over real XLA."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tpudist
from tpudist import contract

REPO = Path(__file__).resolve().parents[2]
TABLES = (37, 23)
FEATURES = 4
DENSE = 5
BATCH = 16
STEPS = 8
LR = 0.05


# -- a small click model, written once, run both sharded and as a plain 1-device reference -----------

def _data(step: int):
    rng = np.random.default_rng([7, step])
    dense = rng.normal(size=(BATCH, DENSE)).astype(np.float32)
    ids = np.stack([rng.integers(0, n, BATCH) for n in TABLES], axis=1).astype(np.int32)
    labels = ((ids[:, 0] % 3 == 0) ^ (dense[:, 0] > 0)).astype(np.float32)
    return dense, ids, labels


def _start():
    rng = np.random.default_rng(3)
    tables = [rng.normal(scale=0.3, size=(n, FEATURES)).astype(np.float32) for n in TABLES]
    mlp = {"w_dense": rng.normal(scale=0.3, size=(DENSE, 8)).astype(np.float32),
           "w_emb": rng.normal(scale=0.3, size=(len(TABLES) * FEATURES, 8)).astype(np.float32),
           "w_out": rng.normal(scale=0.3, size=(8, 1)).astype(np.float32)}
    return tables, mlp


def _head(mlp, dense, vectors):
    import jax
    hidden = jax.nn.relu(dense @ mlp["w_dense"] + vectors.reshape(vectors.shape[0], -1) @ mlp["w_emb"])
    return (hidden @ mlp["w_out"])[:, 0]


def _bce(logits, labels):
    import jax.numpy as jnp
    return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)


def _reference_losses() -> list[float]:
    """Plain jax.jit on this process's first device: dense tables, the whole global batch."""
    import jax
    import jax.numpy as jnp
    tables, mlp = _start()
    params = {"tables": [jnp.asarray(t) for t in tables], "mlp": jax.tree.map(jnp.asarray, mlp)}

    def loss_fn(p, dense, ids, labels):
        vectors = jnp.stack([p["tables"][t][ids[:, t]] for t in range(len(TABLES))], axis=1)
        return _bce(_head(p["mlp"], dense, vectors), labels)

    @jax.jit
    def step(p, dense, ids, labels):
        loss, grads = jax.value_and_grad(loss_fn)(p, dense, ids, labels)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), loss

    losses = []
    for i in range(STEPS):
        params, loss = step(params, *_data(i))
        losses.append(float(loss))
    return losses


def _train_sharded(index: int):
    import jax
    from jax.sharding import PartitionSpec as P
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})
    emb = tpudist.ShardedEmbedding(list(TABLES), FEATURES, mesh=mesh, axis="model")
    tables, mlp = _start()
    params = {"table": emb.shard(tables), "mlp": mlp}

    def train_step(p, dense, ids, labels):
        def loss_fn(p):
            return _bce(_head(p["mlp"], dense, emb(p["table"], ids)), labels)
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), loss

    step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, P("data"), P("data"), P("data")),
                           donate_argnums=0)
    rows = tpudist.mesh.process_slice(mesh, (BATCH,), P("data"))[0]
    before = tpudist.compile_stats()
    losses = []
    for i in range(STEPS):
        dense, ids, labels = _data(i)
        params, loss = step(params, dense[rows], ids[rows], labels[rows])
        losses.append(float(loss))
    table_spec_kept = params["table"].sharding.is_equivalent_to(emb.sharding, 2)
    after = tpudist.compile_stats()
    counts = {"step": step.stats.compiles, "total": after.compiles - before.compiles,
              "calls": after.calls - before.calls}
    # A different batch size is a new signature: one more compile, then the first is reused.
    dense, ids, labels = _data(0)
    half = slice(rows.start, rows.start + (rows.stop - rows.start) // 2)
    params, _ = step(params, dense[half], ids[half], labels[half])
    params, _ = step(params, dense[rows], ids[rows], labels[rows])
    counts["after_new_shape"] = step.stats.compiles
    return {"rows": (rows.start, rows.stop), "losses": losses, "counts": counts,
            "table_spec_kept": table_spec_kept,
            "reference": _reference_losses() if index == 0 else None}


def test_two_process_step_follows_single_device_reference_and_compiles_once():
    results = tpudist.spawn(_train_sharded, nprocs=2, cpu_devices=2, timeout=120)
    reference = results[0]["reference"]
    assert reference[-1] < reference[0]  # the reference learns, so following it means something
    for rank, r in enumerate(results):
        assert r["rows"] == (rank * BATCH // 2, (rank + 1) * BATCH // 2)
        np.testing.assert_allclose(r["losses"], reference, rtol=2e-4, atol=1e-5)
        assert r["table_spec_kept"]
        assert r["counts"] == {"step": 1, "total": 1, "calls": STEPS, "after_new_shape": 2}


# -- per-device steps and in-graph collectives -----------------------------------------------------

def _per_device(index: int):
    import jax
    from jax.sharding import PartitionSpec as P
    mesh = tpudist.mesh.make_mesh({"data": 2, "model": 2})  # "model" inside each process

    def sums(block):
        return jax.lax.psum(block.sum(axis=0), "data"), jax.lax.psum(block, "model")

    step = tpudist.compile(sums, mesh=mesh, in_specs=(P("data", "model"),), per_device=True,
                           out_specs=(P("model"), P("data", "model")))
    rows = tpudist.mesh.process_slice(mesh, (8, 4), P("data", "model"))
    column_sums, neighbours = step(_GLOBAL_X[rows])  # this process's rows, every column
    emb = tpudist.ShardedEmbedding(10, 3, mesh=mesh, axis="model")
    table = emb.shard(_DENSE_TABLE)
    lookups = {}
    for name, spec in (("same_over_model", P("data")), ("split_over_model", P(("data", "model")))):
        look = tpudist.compile(lambda t, i: emb(t, i), mesh=mesh, in_specs=(None, spec),
                               out_specs=spec, per_device=True)
        lookups[name] = _gather(look(table, _IDS))
    return {"rows": [(s.start, s.stop) for s in rows], "column_sums": _gather(column_sums),
            "neighbours": _gather(neighbours), "lookups": lookups}


_GLOBAL_X = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
_DENSE_TABLE = np.arange(30, dtype=np.float32).reshape(10, 3)
_IDS = np.array([[0, 4], [5, 9], [9, 0], [4, 5]], dtype=np.int32)  # 5 rows per shard: 4|5 is an edge


def _gather(x):
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _per_device_and_errors(index: int):
    return {"per_device": _per_device(index), "errors": _errors(index)}


@pytest.fixture(scope="module")
def two_by_two():
    """One 2-process x 2-device job for the per-device and argument checks below."""
    return tpudist.spawn(_per_device_and_errors, nprocs=2, cpu_devices=2, timeout=180)


def test_per_device_step_runs_in_graph_collectives_and_sharded_lookup(two_by_two):
    results = [r["per_device"] for r in two_by_two]
    left, right = _GLOBAL_X[:, :2], _GLOBAL_X[:, 2:]
    for rank, r in enumerate(results):
        assert r["rows"] == [(4 * rank, 4 * rank + 4), (0, 4)]
        # psum over "data" of each device's column sums: the global column sums.
        np.testing.assert_allclose(r["column_sums"], _GLOBAL_X.sum(axis=0))
        # psum over "model": each block plus its neighbour's along "model".
        np.testing.assert_allclose(r["neighbours"], np.concatenate([left + right] * 2, axis=1))
        # Both processes passed the same local ids, so the global ids are them twice.
        expected = np.concatenate([_DENSE_TABLE[_IDS]] * 2)
        for name, got in r["lookups"].items():
            np.testing.assert_allclose(got, expected, err_msg=name)


# -- argument handling and errors ------------------------------------------------------------------

def _errors(index: int):
    from jax.sharding import PartitionSpec as P
    mesh = tpudist.mesh.make_mesh({"data": -1})
    messages = {}
    step = tpudist.compile(lambda a, b: a + b, mesh=mesh, in_specs=(P("data"),))
    try:
        step(np.ones(2), np.ones(2))
    except ValueError as e:
        messages["in_specs_length"] = str(e)
    step = tpudist.compile(lambda a, n: a * len(n), mesh=mesh, static_argnums=1)
    try:
        step(np.ones(2), [1, 2])
    except TypeError as e:
        messages["unhashable_static"] = str(e)
    try:
        tpudist.compile(lambda a: a, mesh=mesh, per_device=True)(np.ones(2))
    except ValueError as e:
        messages["per_device_out_specs"] = str(e)
    step = tpudist.compile(lambda a: a.sum(), mesh=mesh, in_specs=(P("nope"),), name="summed")
    try:
        step(np.ones(2))
    except ValueError as e:
        messages["bad_spec"] = str(e)
    # Static values are baked in: two values, two compiles; the same value again, none.
    scaled = tpudist.compile(lambda a, k: a * k, mesh=mesh, in_specs=(P("data"), None), static_argnums=1)
    outs = [float(_gather(scaled(np.ones(2), k)).sum()) for k in (2, 3, 2)]
    return {"messages": messages, "static_outs": outs, "static_compiles": scaled.stats.compiles}


def test_argument_errors_name_the_problem_and_static_args_are_baked_in(two_by_two):
    results = [r["errors"] for r in two_by_two]
    for r in results:
        m = r["messages"]
        assert "in_specs has 1 entries for 2 arguments" in m["in_specs_length"]
        assert "static arguments must be hashable" in m["unhashable_static"]
        assert "per_device=True needs out_specs" in m["per_device_out_specs"]
        assert r["static_outs"] == [8.0, 12.0, 8.0]
        assert r["static_compiles"] == 2
        assert re.search(r"rank \d: summed: argument 0 \(shape \(2,\), spec P\('nope',?\)\)",
                         m["bad_spec"]), m["bad_spec"]


def test_compile_checks_its_arguments_before_any_device_work():
    with pytest.raises(TypeError, match="make_mesh"):
        tpudist.compile(lambda x: x, mesh={"data": 2})
    with pytest.raises(ValueError, match="both donated and static"):
        tpudist.compile(lambda x: x, mesh=None, donate_argnums=0, static_argnums=0)
    with pytest.raises(TypeError, match="expects a JAX function"):
        tpudist.compile(42, mesh=None)


# -- persistent compilation cache -------------------------------------------------------------------

def _cached_step(index: int):
    from jax.sharding import PartitionSpec as P
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("tpudist.compile").addHandler(Keep())
    logging.getLogger("tpudist.compile").setLevel(logging.INFO)
    mesh = tpudist.mesh.make_mesh({"data": -1})
    step = tpudist.compile(lambda a: (a * 3.0 + 1.0).sum(), mesh=mesh, in_specs=(P("data"),))
    value = float(step(np.arange(4, dtype=np.float32)))
    stats = tpudist.compile_stats()
    return {"value": value, "compiles": stats.compiles, "hits": stats.cache_hits,
            "seconds": stats.compile_seconds, "log": records}


@pytest.mark.parametrize("nprocs,cpu_devices", [(1, 2), (2, 1)], ids=["one_process", "two_processes"])
def test_persistent_cache_hit_is_counted_and_logged_on_every_process(tmp_path, nprocs, cpu_devices):
    """A job started again (a restart, the next run) loads its programs from the persistent cache
    on every process, not on process 0 alone (JAX writes entries from process 0 only, and on a CPU
    mesh every process has keys of its own: tpudist._jaxcompat.cache_writes_from_every_process)."""
    env = {contract.CACHE_DIR: str(tmp_path / "xla")}
    first = tpudist.spawn(_cached_step, nprocs=nprocs, cpu_devices=cpu_devices, env=env, timeout=60)
    second = tpudist.spawn(_cached_step, nprocs=nprocs, cpu_devices=cpu_devices, env=env, timeout=60)
    for rank, (a, b) in enumerate(zip(first, second)):
        # each process gives its rows of the global batch: np.arange(4) each
        assert a["value"] == b["value"] == nprocs * float((np.arange(4) * 3 + 1).sum()), rank
        assert (a["compiles"], a["hits"]) == (1, 0), f"rank {rank}: {a}"
        assert (b["compiles"], b["hits"]) == (1, 1), f"rank {rank} compiled again after a restart: {b}"
        assert any("compiled in" in line for line in a["log"])
        assert any("loaded from the persistent compilation cache" in line for line in b["log"])
    assert any(tmp_path.joinpath("xla").iterdir())


# -- the DLRM example, started the way the launcher starts a job ----------------------------------------

@pytest.mark.slow
def test_dlrm_example_trains_on_two_processes_of_two_devices(tmp_path):
    """Stand-in for `python -m tpudist.xla_dist --local --nproc-per-host 2 --cpu-devices 2`: this
    test writes the environment contract for 2 processes itself and starts the example in each."""
    from tpudist._spawn import free_port
    coordinator, master_port = f"127.0.0.1:{free_port()}", free_port()
    procs = []
    for rank in range(2):
        job = contract.JobEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                              coordinator=coordinator, master_addr="127.0.0.1", master_port=master_port,
                              host="localhost", cpu_devices=2, platform="cpu", job_id="dlrm-test")
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "train_dlrm.py"), "--steps", "60",
             "--global-batch", "128", "--log-every", "20", "--lr", "0.01"],
            env={**os.environ, **job.to_environ()}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + 240
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    out = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    assert [p.returncode for p in procs] == [0, 0], out
    lines = [line for line in out[0].splitlines() if not line.startswith("[Gloo]")]
    assert "mesh data(2) x model(2) over 4 devices in 2 processes" in lines[0]
    assert "compiled 1x" in lines[-2]
    match = re.fullmatch(r"loss (\d+\.\d+) -> (\d+\.\d+)  \((\d+) examples/s\)", lines[-1])
    assert match, lines[-1]
    first, last, rate = float(match[1]), float(match[2]), int(match[3])
    assert last < first - 0.05 and rate > 0
    assert "loss" not in "".join(l for l in out[1].splitlines() if not l.startswith("[Gloo]"))


def test_compile_is_a_typed_function_whatever_was_imported_before():
    """`tpudist.compile` is a plain function with its options in its signature (help(), IDEs), even
    after the subpackage `tpudist.compile` holding its implementation has been imported."""
    import inspect
    import tpudist.compile._torch  # noqa: F401  (binds the subpackage on `tpudist` for plain modules)
    from tpudist.compile import supported_torch_ops
    assert inspect.isfunction(tpudist.compile)
    params = inspect.signature(tpudist.compile).parameters
    assert list(params)[:1] == ["fn"]
    assert {"mesh", "in_specs", "out_specs", "donate_argnums", "static_argnums", "per_device", "name"} <= set(params)
    assert "in_specs" in tpudist.compile.__doc__ and supported_torch_ops() == tpudist.supported_torch_ops()
    with pytest.raises(TypeError, match="make_mesh"):
        tpudist.compile(lambda x: x)
