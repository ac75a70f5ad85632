"""tpudist.mesh: sizes and errors, topology-aware placement, axis <-> process groups, process slices.

Placement over many hosts is checked on stand-in device objects (plain dataclasses with the `id`,
`process_index` and `slice_index` attributes real devices have), because this machine cannot run
8 processes or a multi-slice TPU job; the real 2-process x 2-device mesh is checked in real processes.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import tpudist
from tpudist.mesh import Axis, axis_groups, describe, make_mesh


@dataclasses.dataclass(frozen=True)
class StandInDevice:
    """Stand-in for a jax Device on a topology this machine cannot run."""

    id: int
    process_index: int
    slice_index: int | None = None
    platform: str = "cpu"
    device_kind: str = "cpu"


def hosts(processes: int, per_process: int, slices: int | None = None) -> list[StandInDevice]:
    per_slice = processes // slices if slices else None
    devices = [StandInDevice(p * per_process + i, p, p // per_slice if slices else None)
               for p in range(processes) for i in range(per_process)]
    random.Random(0).shuffle(devices)  # make_mesh must not depend on the order it is given
    return devices


def processes_of(mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(mesh.devices)


def test_minus_one_takes_what_is_left():
    mesh = make_mesh({"data": -1, "model": 2}, devices=hosts(4, 2))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_names == ("data", "model")
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("axes, message", [
    ({"data": 3, "model": 2}, r"data\(3\) \* model\(2\) = 6 != 8 devices"),
    ({"data": -1, "model": 3}, r"model\(3\) = 3 does not divide 8 devices, so data\(-1\)"),
    ({"data": -1, "model": -1}, r"only one mesh axis may be -1"),
    ({"data": 0}, r"mesh axis 'data' has size 0"),
])
def test_sizes_that_do_not_fit_show_the_arithmetic(axes, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(axes, devices=hosts(4, 2))


@pytest.mark.parametrize("axes", [{}, {"data": 2.0}, {3: 8}, [("data", 8)]])
def test_malformed_axes_are_type_errors(axes):
    with pytest.raises(TypeError):
        make_mesh(axes, devices=hosts(4, 2))


def test_model_axis_stays_inside_a_process_and_data_spans_processes():
    mesh = make_mesh({"data": -1, "model": 2}, devices=hosts(4, 2))
    procs = processes_of(mesh)
    assert all(len(set(row)) == 1 for row in procs)  # each "model" group: one process
    assert len(set(procs[:, 0])) == 4  # "data" crosses all four processes
    assert axis_groups(mesh, "data") == [[0, 1, 2, 3]]
    assert axis_groups(mesh, "model") == [[0], [1], [2], [3]]


def test_the_last_axis_is_the_inner_one_whatever_its_name():
    mesh = make_mesh({"model": 2, "data": -1}, devices=hosts(4, 2))
    assert all(len(set(row)) == 2 for row in processes_of(mesh))  # "data" pairs live in a process
    assert axis_groups(mesh, "model") == [[0, 2], [1, 3]]


def test_an_axis_larger_than_a_process_is_filled_process_by_process():
    mesh = make_mesh({"data": 2, "model": 4}, devices=hosts(4, 2))
    assert processes_of(mesh).tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert axis_groups(mesh, "model") == [[0, 1], [2, 3]]
    assert axis_groups(mesh, "data") == [[0, 2], [1, 3]]


def test_multislice_granules_are_slices():
    # 2 slices x 2 hosts x 2 devices: "model" and "fsdp" stay in a slice (ICI), "data" crosses (DCN).
    mesh = make_mesh({"data": 2, "fsdp": 2, "model": 2}, devices=hosts(4, 2, slices=2))
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()


def test_uneven_processes_still_give_a_full_mesh():
    devices = [StandInDevice(0, 0), StandInDevice(1, 0), StandInDevice(2, 0), StandInDevice(3, 1)]
    mesh = make_mesh({"data": 2, "model": 2}, devices=devices)
    assert sorted(d.id for d in mesh.devices.flat) == [0, 1, 2, 3]
    assert processes_of(mesh).tolist() == [[0, 0], [0, 1]]


def test_axis_groups_reject_overlapping_groups_and_unknown_axes():
    class Skewed:  # a hand-made layout where "data" pairs processes inconsistently
        axis_names = ("data", "model")
        devices = np.array([[StandInDevice(0, 0), StandInDevice(1, 1)],
                            [StandInDevice(2, 1), StandInDevice(3, 2)]], dtype=object)
    with pytest.raises(ValueError, match="process 1 is in"):
        axis_groups(Skewed(), "model")
    with pytest.raises(ValueError, match=r"no axis 'tensor'; its axes are \['data', 'model'\]"):
        axis_groups(Skewed(), "tensor")


def test_axis_names_are_plain_strings():
    mesh = make_mesh({Axis.DATA: -1, Axis.MODEL: 2}, devices=hosts(2, 2))
    assert mesh.axis_names == ("data", "model")
    assert describe(mesh) == "data(2) x model(2) over 4 devices in 2 processes"


# -- the real thing: 2 processes x 2 CPU devices ----------------------------------------------------

def _real_mesh(index: int):
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    out = {}
    mesh = make_mesh({"data": -1, "model": 2})
    out["shape"] = dict(mesh.shape)
    out["ids"] = np.vectorize(lambda d: d.id)(mesh.devices).tolist()
    out["procs"] = processes_of(mesh).tolist()
    out["groups"] = {axis: axis_groups(mesh, axis) for axis in mesh.axis_names}
    # Each process passes its own rows; the global array is their concatenation along "data".
    batch = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows = tpudist.mesh.process_slice(mesh, batch.shape, P("data"))
    out["rows"] = [(s.start, s.stop) for s in rows]
    assembled = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), batch[rows])
    out["assembled"] = np.asarray(multihost_utils.process_allgather(assembled, tiled=True))
    wide = make_mesh({"model": -1})
    out["wide_groups"] = axis_groups(wide, "model")
    out["wide_rows"] = [(s.start, s.stop) for s in tpudist.mesh.process_slice(wide, (8,), P("model"))]
    try:
        make_mesh({"data": 3, "model": 2})
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_real_two_process_mesh():
    results = tpudist.spawn(_real_mesh, nprocs=2, cpu_devices=2, timeout=120)
    for rank, r in enumerate(results):
        assert r["shape"] == {"data": 2, "model": 2}
        assert r["procs"] == [[0, 0], [1, 1]]
        assert sorted(sum(r["ids"], [])) == sorted(sum(results[0]["ids"], []))  # same mesh everywhere
        assert r["groups"] == {"data": [[0, 1]], "model": [[0], [1]]}
        assert r["rows"] == [(3 * rank, 3 * rank + 3), (0, 2)]
        np.testing.assert_array_equal(r["assembled"], np.arange(12).reshape(6, 2))
        assert r["wide_groups"] == [[0, 1]]
        assert r["wide_rows"] == [(4 * rank, 4 * rank + 4)]
        assert "data(3) * model(2) = 6 != 4 devices" in r["error"]
