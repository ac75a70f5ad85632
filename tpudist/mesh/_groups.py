"""Between mesh axes and processes: the eager collectives' process groups, and each process's slice."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any


class Axis(str, enum.Enum):
    """Conventional mesh axis names; plain strings work everywhere an axis name is expected.

    `Axis.DATA == "data"`, so `make_mesh({Axis.DATA: -1, Axis.MODEL: 2})` and
    `PartitionSpec(Axis.DATA)` mean the same as with the strings.
    """

    DATA = "data"  # batch split; gradients are averaged over it
    MODEL = "model"  # parameters split (sharded embedding rows, tensor parallelism)

    def __str__(self) -> str:
        return self.value


def _axis_index(mesh: Any, axis: str) -> int:
    names = list(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {names}")
    return names.index(axis)


def axis_groups(mesh: Any, axis: str) -> list[list[int]]:
    """The process groups along mesh axis `axis`, for the `groups=` argument of eager collectives.

    Each group lists the processes (ranks) whose devices share every coordinate except `axis`,
    sorted; the groups are sorted too. An eager collective with these groups combines one value per
    process, so it matches the in-graph collective over `axis` when each process holds one
    position along `axis`. Example on 2 processes x 2 devices with `{"data": 2, "model": 2}`::

        axis_groups(mesh, "data")    # [[0, 1]]    "data" spans the processes
        axis_groups(mesh, "model")   # [[0], [1]]  "model" lives inside each process

    An axis that lives inside each process gives one singleton group per process: an eager
    collective over it returns each process's own value, and the reduction over that axis's
    devices has to happen in-graph (`tpudist.all_reduce(x, axis=...)` inside `tpudist.compile`,
    or `jax.lax.psum`). Raises ValueError when the axis does not cut the processes into disjoint
    groups (a process would be in two groups), which `make_mesh` layouts never do.
    """
    import numpy as np
    index = _axis_index(mesh, str(axis))
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    rows = np.moveaxis(procs, index, -1).reshape(-1, procs.shape[index])
    groups = sorted({tuple(sorted(set(row.tolist()))) for row in rows})
    seen: dict[int, tuple[int, ...]] = {}
    for group in groups:
        for p in group:
            if p in seen:
                raise ValueError(f"mesh axis {axis!r} does not split the processes into disjoint groups: "
                                 f"process {p} is in {list(seen[p])} and {list(group)}; build the mesh "
                                 "with tpudist.mesh.make_mesh, or reduce over this axis in-graph")
            seen[p] = group
    return [list(g) for g in groups]


def process_slice(mesh: Any, global_shape: Sequence[int], spec: Any = None,
                  process_index: int | None = None) -> tuple[slice, ...]:
    """The block of a global array that one process holds (default: this process).

    `spec` is the array's `PartitionSpec` on `mesh` (default: the first dim split over the mesh's
    first axis). Use it to cut the process-local slice of a batch that is defined globally, e.g.
    deterministic data::

        rows = tpudist.mesh.process_slice(mesh, (global_batch,), P("data"))[0]
        step(params, features[rows], labels[rows])

    Raises ValueError when the process's part is not one contiguous block (a mesh whose split
    axis interleaves processes); `make_mesh` layouts are always contiguous.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    if spec is None:
        spec = PartitionSpec(mesh.axis_names[0])
    if process_index is None:
        process_index = jax.process_index()
    shape = tuple(int(s) for s in global_shape)
    index_map = NamedSharding(mesh, spec).devices_indices_map(shape)
    mine = [idx for d, idx in index_map.items() if d.process_index == process_index]
    if not mine:
        raise ValueError(f"process {process_index} has no device in this mesh")
    block = []
    for dim, size in enumerate(shape):
        spans = {(s[dim].start or 0, size if s[dim].stop is None else s[dim].stop) for s in mine}
        start, stop = min(a for a, _ in spans), max(b for _, b in spans)
        covered = sum(b - a for a, b in spans)
        if covered != stop - start:
            raise ValueError(f"process {process_index}'s part of dim {dim} (spec {spec}) is not "
                             f"contiguous: {sorted(spans)}; build the mesh with make_mesh")
        block.append(slice(start, stop))
    # The per-dim ranges form the process's block only if it holds every part of it.
    held = {tuple((s.start or 0, size if s.stop is None else s.stop) for s, size in zip(idx, shape))
            for idx in mine}
    held_volume = sum(math.prod(b - a for a, b in spans) for spans in held)
    if held_volume != math.prod(s.stop - s.start for s in block):
        raise ValueError(f"process {process_index}'s part of an array of shape {shape} (spec {spec}) "
                         f"is not one block; build the mesh with make_mesh")
    return tuple(block)
