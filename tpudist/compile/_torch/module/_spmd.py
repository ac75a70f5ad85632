"""Running a compiled module's graph as one SPMD program over the processes of the job.

A plain `tpudist.compile(module)` graph runs on each process alone, except when it holds an op
that reaches other processes (`tpudist.nn.ShardedEmbedding`'s lookup): then its forward and
backward run under `shard_map` over a mesh of one device per process (axis "data"), every input
and output carrying a leading process axis, and the lookup lowers to in-graph collectives. Every
process must then call the module together, as with the eager module's collectives.

Backward recomputes the forward inside its executable (the forward's residuals cannot leave a
`shard_map` as a VJP closure), trading one extra forward for the cross-process graph.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpudist._jaxcompat import assemble
from tpudist.compile._torch.lowering.ops.collective import over_axis

AXIS = "data"


class ProcessMesh:
    """`run(arrays, seed)` of a lowered graph, as a global function over one device per process."""

    def __init__(self, run: Callable[[Sequence[jax.Array], Any], tuple[Any, ...]]):
        first: dict[int, Any] = {}
        for device in jax.devices():
            first.setdefault(device.process_index, device)
        self.count = len(first)
        self.mesh = Mesh(np.array([first[p] for p in sorted(first)]), (AXIS,))
        self.device = first[jax.process_index()]
        self.sharding = NamedSharding(self.mesh, P(AXIS))
        count = self.count

        def per_process(arrays: list[jax.Array], seed: jax.Array) -> list[jax.Array]:
            with over_axis(AXIS, count):
                outs = run([a[0] for a in arrays], seed[0])
            return [o[None] for o in outs]

        self.run = jax.shard_map(per_process, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS))

    def to_global(self, array: Any) -> jax.Array:
        """This process's array as its slice (1, *shape) of a (processes, *shape) global array."""
        local = jax.device_put(array, self.device)
        local = local.reshape((1, *local.shape))
        return assemble((self.count, *local.shape[1:]), self.sharding, [local])

    @staticmethod
    def to_local(array: jax.Array) -> jax.Array:
        """This process's slice of a (processes, *shape) global array, as a (*shape) array."""
        return array.addressable_data(0).reshape(array.shape[1:])
