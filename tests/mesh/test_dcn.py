"""Meshes over several slices: `make_mesh(..., dcn=...)`, the slice contract, emulated CPU slices.

Topologies this machine cannot run (16 devices in 2 TPU slices) are checked on stand-in devices that
carry `slice_index` as TPU devices do; the emulated slices (`MEGASCALE_NUM_SLICES` grouping the
processes of a CPU mesh) are checked in a real 4-process job.
"""

from __future__ import annotations

import numpy as np
import pytest

import tpudist
from tpudist import contract
from tpudist.mesh import axis_groups, describe, make_mesh
from test_mesh import StandInDevice, hosts, processes_of


def slices_of(mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.slice_index)(mesh.devices)


def ids_of(array) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(array)


def test_dcn_axes_are_outermost_and_ici_axes_stay_inside_a_slice():
    # 2 slices x 2 hosts x 4 devices: axes gives the shape inside a slice, dcn the slices.
    devices = hosts(4, 4, slices=2)
    mesh = make_mesh({"data": -1, "model": 4}, dcn={"data": 2}, devices=devices)
    assert dict(mesh.shape) == {"data": 4, "model": 4}
    assert slices_of(mesh)[:, 0].tolist() == [0, 0, 1, 1]  # data's outer part crosses slices
    assert all(len(set(row)) == 1 for row in processes_of(mesh))  # each model group: one host
    # The same layout jax's own hybrid mesh gives.
    from jax.experimental import mesh_utils
    reference = mesh_utils.create_hybrid_device_mesh([2, 4], [2, 1], sorted(devices, key=lambda d: d.id))
    np.testing.assert_array_equal(ids_of(mesh.devices), ids_of(reference))
    assert axis_groups(mesh, "data") == [[0, 1, 2, 3]]
    assert axis_groups(mesh, "model") == [[0], [1], [2], [3]]


def test_an_axis_split_over_dcn_and_ici_and_a_dcn_only_axis():
    devices = hosts(4, 2, slices=2)  # 2 slices of 4 devices (2 hosts each)
    mesh = make_mesh({"replica": 1, "fsdp": 4}, dcn={"replica": 2}, devices=devices)
    assert dict(mesh.shape) == {"replica": 2, "fsdp": 4}
    assert slices_of(mesh).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    mesh = make_mesh({"data": 2, "model": 2}, dcn={"model": 2}, devices=devices)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert slices_of(mesh).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]  # model = (dcn 2) x (ici 2)
    assert axis_groups(mesh, "model") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("axes, dcn, message", [
    ({"data": -1, "model": 4}, {"data": 3}, r"dcn data\(3\) \* model\(1\) = 3 != 2 slices \(from the "
                                            r"devices' slice_index\)"),
    ({"data": 3, "model": 4}, {"data": 2}, r"ici data\(3\) \* model\(4\) = 12 != 8 devices per slice"),
    ({"data": -1, "model": 3}, {"data": 2}, r"ici model\(3\) = 3 does not divide 8 devices per slice, "
                                            r"so data\(-1\)"),
    ({"data": -1, "model": 4}, {"replica": 2}, r"dcn names \['replica'\], not axes of the mesh "
                                               r"\['data', 'model'\]"),
    ({"data": -1, "model": 4}, {"data": -1, "model": -1}, r"only one mesh axis may be -1"),
])
def test_dcn_shapes_that_do_not_fit_show_the_arithmetic(axes, dcn, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(axes, dcn=dcn, devices=hosts(4, 4, slices=2))


def test_dcn_on_a_single_slice_job_and_unequal_slices_are_errors():
    with pytest.raises(ValueError, match=r"dcn data\(2\) \* model\(1\) = 2 != 1 slices "
                                         r"\(MEGASCALE_NUM_SLICES unset\); make the product"):
        make_mesh({"data": -1, "model": 2}, dcn={"data": 2}, devices=hosts(2, 2))
    devices = [StandInDevice(i, i // 2, 0 if i < 6 else 1) for i in range(8)]
    with pytest.raises(ValueError, match="unequal device counts \\(slice 0: 6, slice 1: 2\\)"):
        make_mesh({"data": -1}, dcn={"data": 2}, devices=devices)
    with pytest.raises(TypeError, match="dcn must be a mapping"):
        make_mesh({"data": -1}, dcn=[("data", 2)], devices=hosts(4, 2, slices=2))


def test_without_dcn_the_slices_are_the_granules():
    mesh = make_mesh({"data": -1, "model": 4}, devices=hosts(4, 2, slices=2))
    assert slices_of(mesh).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert all(len(set(pair)) == 1 for row in processes_of(mesh) for pair in (row[:2], row[2:]))


def test_the_slice_contract_groups_ranks_slice_major():
    job = contract.JobEnv(rank=3, world_size=4, coordinator="h:1", local_world_size=1,
                          local_rank=0, num_slices=2, slice_id=1)
    assert [job.slice_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert job.to_environ()["MEGASCALE_NUM_SLICES"] == "2" and job.to_environ()["MEGASCALE_SLICE_ID"] == "1"
    assert contract.JobEnv.from_environ(job.to_environ()) == job
    assert "MEGASCALE_NUM_SLICES" not in contract.JobEnv().to_environ()  # one slice: libtpu sees nothing
    base = {"WORLD_SIZE": "4", "RANK": "1", "TPUDIST_COORDINATOR": "h:1"}
    with pytest.raises(ValueError, match=r"MEGASCALE_NUM_SLICES=3 must be a positive divisor of WORLD_SIZE=4"):
        contract.JobEnv.from_environ({**base, "MEGASCALE_NUM_SLICES": "3"})
    with pytest.raises(ValueError, match=r"MEGASCALE_SLICE_ID=1 but RANK=1 is in slice 0: ranks are "
                                         r"slice-major, 2 processes per slice"):
        contract.JobEnv.from_environ({**base, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"})


# -- the real thing: 2 emulated slices of 2 processes x 1 CPU device --------------------------------

def _emulated_slices():
    import jax
    from jax.sharding import PartitionSpec as P
    rank = tpudist.process_index()
    out = {"slice": tpudist.slice_index(), "num_slices": tpudist.num_slices()}
    mesh = make_mesh({"data": -1, "model": 2}, dcn={"data": 2})
    out["shape"] = dict(mesh.shape)
    out["procs"] = processes_of(mesh).tolist()
    out["groups"] = {axis: axis_groups(mesh, axis) for axis in mesh.axis_names}
    out["describe"] = describe(mesh)
    # In-graph: each device holds its process's row; psum over the DCN axis "data".
    mine = np.arange(3, dtype=np.float32) * (rank + 1) + 10 * rank
    step = tpudist.compile(lambda x: jax.lax.psum(x, "data"), mesh=mesh, per_device=True,
                           in_specs=P(("data", "model")), out_specs=P(("data", "model")))
    out["in_graph"] = np.asarray(step(mine[None]).addressable_shards[0].data)[0]
    # Eager: the same reduction over the processes axis_groups names for "data".
    out["eager"] = tpudist.all_reduce(mine, groups=axis_groups(mesh, "data"))
    for axes, dcn in (({"data": -1, "model": 2}, {"data": 4}), ({"data": 3, "model": 2}, {"data": 2})):
        try:
            make_mesh(axes, dcn=dcn)
        except ValueError as e:
            out.setdefault("errors", []).append(str(e))
    return out


def test_two_emulated_slices_all_reduce_over_the_dcn_axis_equals_numpy():
    from tpudist.testing import run_on_mesh
    results = run_on_mesh(_emulated_slices, nprocs=4, cpu_devices=1, timeout=240,
                          env={contract.NUM_SLICES: "2"})
    rows = np.stack([np.arange(3, dtype=np.float32) * (r + 1) + 10 * r for r in range(4)])
    for rank, r in enumerate(results):
        assert (r["slice"], r["num_slices"]) == (rank // 2, 2)
        assert r["shape"] == {"data": 2, "model": 2}
        assert r["procs"] == [[0, 1], [2, 3]]  # a slice is a row: "data" crosses slices over DCN
        assert r["groups"] == {"data": [[0, 2], [1, 3]], "model": [[0, 1], [2, 3]]}
        assert r["describe"] == "data(2) x model(2) over 4 devices in 4 processes, 2 slices"
        expected = rows[rank % 2] + rows[rank % 2 + 2]  # the two slices' rows at this model index
        np.testing.assert_array_equal(r["in_graph"], expected)
        np.testing.assert_array_equal(r["eager"], expected)
        assert "dcn data(4) * model(1) = 4 != 2 slices (MEGASCALE_NUM_SLICES=2)" in r["errors"][0]
        assert "ici data(3) * model(2) = 6 != 2 devices per slice" in r["errors"][1]
