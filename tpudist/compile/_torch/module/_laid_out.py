"""One captured graph run over the mesh of a model laid out by `tpudist.parallelize` (`_layout`).

The parameters are the layout's global arrays, the other inputs replicated, and the program is
`jax.jit` over the whole mesh: XLA's SPMD partitioner inserts the collectives. Outputs come back
whole, on every process; an input the graph writes (a static KV cache, see `_resident`) stays on
the devices, laid out as what its first call writes into it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist.compile._torch._convert import to_host
from tpudist.compile._torch._placement import relaid
from tpudist.compile._torch.lowering._captured import Captured
from tpudist.compile._torch.lowering._parallel import MeshLayout, laid_out


class MeshRun:
    """The executables of one graph over a layout's mesh, one per set of input shardings."""

    def __init__(self, captured: Captured, run: Callable[[list[jax.Array], Any], tuple[Any, ...]]):
        self._outputs = len(captured.outputs)
        self._run = run
        self._compiled: dict[tuple, Any] = {}
        self._learned: dict[int, P] = {}  # a written input's layout on the mesh, by input position
        self.compiles = 0

    def resident_spec(self, position: int) -> P:
        """How a written input is laid out on the mesh (learned at its first write; P() before)."""
        return self._learned.get(position, P())

    def forward(self, arrays: list[jax.Array], seed: Any, layout: Any, written: dict[int, int],
                scatters: dict[int, Any], donate: tuple[int, ...] = ()) -> list[Any]:
        """Every output of the graph: the written inputs' new arrays (outputs at `written`) stay on
        the devices, laid out as their inputs are; the rest cross to the host whole. At a written
        input's first call its layout is learned from what the call writes into it (a KV cache
        splits over heads as the new keys do): that call's executable leaves the write's layout
        to XLA, and is not kept. The arrays at input positions `donate` (written inputs: kept on the
        devices, or fresh copies) are the executable's to update in place, once their layout is
        learned."""
        donate = tuple(position for position in donate if position in self._learned)
        key = (tuple(a.sharding for a in arrays), donate)
        compiled = self._compiled.get(key)
        learn: dict[int, int] = {}
        if compiled is None:
            free = set()
            for j, position in written.items():
                if position not in self._learned:
                    learn[j] = position
                    free.add(j)
                    if j in scatters:
                        free.add(scatters[j].values)
            outs = tuple(None if j in free else arrays[written[j]].sharding if j in written else layout.replicated
                         for j in range(self._outputs))
            with laid_out(MeshLayout(layout.mesh, ())):  # experts split over an "expert" axis (ops/experts.py)
                compiled = _donating(self._run, donate, outs).lower(*_split(arrays, donate), seed).compile()
            self.compiles += 1
            if not learn:
                self._compiled[key] = compiled
        result = list(compiled(*_split(arrays, donate), seed))
        for j, position in learn.items():
            spec = _spec_of(result[scatters[j].values], result[j].shape) if j in scatters else P()
            self._learned[position] = spec
            result[j] = relaid(layout.mesh, spec)(result[j])
        return [value if j in written or not isinstance(value, jax.Array) else whole(value, layout)
                for j, value in enumerate(result)]


def _donating(run: Callable[[list[jax.Array], Any], Any], donate: tuple[int, ...], outs: tuple) -> Any:
    """`run` jitted as `(arrays without those at donate, those at donate, seed)`, the second donated."""
    def merged(arrays: list[Any], written: list[jax.Array], seed: Any) -> Any:
        full = list(arrays)
        for position, array in zip(donate, written):
            full[position] = array
        return run(full, seed)
    return jax.jit(merged, out_shardings=outs, donate_argnums=1 if donate else ())


def _split(arrays: list[jax.Array], donate: tuple[int, ...]) -> tuple[list[Any], list[jax.Array]]:
    gone = frozenset(donate)
    return [None if i in gone else a for i, a in enumerate(arrays)], [arrays[i] for i in donate]


def whole(array: jax.Array, layout: Any) -> jax.Array:
    """`array`'s whole value on the host, where torch can view it (gathered first where the devices
    split it: a collective over the mesh's processes)."""
    if not array.is_fully_replicated:
        array = relaid(layout.mesh)(array)
    return to_host([array.addressable_data(0)])[0]


def _spec_of(written: jax.Array, shape: tuple[int, ...]) -> P:
    """The layout of what a scatter writes, for the array it writes into (`shape`): its
    PartitionSpec where it names the same dimensions and their sizes divide, else P()."""
    sharding = written.sharding
    if not isinstance(sharding, NamedSharding) or len(shape) != written.ndim:
        return P()
    spec = tuple(sharding.spec) + (None,) * (written.ndim - len(tuple(sharding.spec)))
    mesh = sharding.mesh.shape
    for size, entry in zip(shape, spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if size % int(np.prod([mesh[a] for a in axes], dtype=int)):
            return P()
    return P(*spec)
