"""Device meshes over every process's devices, and the way between mesh axes and process groups.

    import tpudist
    from jax.sharding import PartitionSpec as P

    tpudist.init()
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})  # "model" inside a process, "data" across
    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 4}, dcn={"data": 2})   # 2 slices over DCN
    tpudist.mesh.axis_groups(mesh, "data")                 # process groups for eager collectives
    rows = tpudist.mesh.process_slice(mesh, (256,), P("data"))[0]   # this process's part of a batch

See docs/mesh_and_compile.md.
"""

from __future__ import annotations

from tpudist.mesh._build import describe, make_mesh
from tpudist.mesh._groups import Axis, axis_groups, process_slice

__all__ = ["Axis", "axis_groups", "describe", "make_mesh", "process_slice"]
