"""The mesh a sharded step is traced for, as the lowerings that split work over its axes read it.

While a sharded fused step's program, or a laid-out model's (`tpudist.parallelize`), is traced
(`laid_out`), `current()` names the mesh and the axes its batch is split over; `ops/experts.py`
splits a mixture-of-experts layer's experts over an "expert" axis and `ops/attention.py` an
attention's sequence over a "context" axis. Elsewhere (one device, the data-parallel step)
`current()` is None and they compute unsplit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

EXPERT_AXIS = "expert"    # mixture-of-experts layers: experts split over it (expert parallelism)
CONTEXT_AXIS = "context"  # attention: the sequence split over it (context parallelism)
STAGE_AXIS = "stage"      # a run of identical layers split into consecutive stages over it (pipeline parallelism)


@dataclass(frozen=True)
class MeshLayout:
    """The mesh a sharded step runs on and the axes its batch is split over."""

    mesh: Any
    batch_axes: tuple[str, ...]
    sequence: int | None = None  # the batch's sequence length (dim 1 of its first tensor of 2+ dims)

    def size(self, axis: str) -> int:
        """The devices along `axis`; 1 where the mesh has no such axis."""
        return dict(self.mesh.shape).get(axis, 1)


def sequence_split(value: Any) -> Any:
    """Under context parallelism: an activation shaped (rows, sequence, ...) held split like the batch
    (rows over the batch axes, the sequence over "context"); anything else as it is. A layout hint
    (`with_sharding_constraint`), never a change of value: without it XLA's partitioner gathers the
    sequence back before the layers' MLPs."""
    layout = current()
    if layout is None or layout.sequence is None or layout.size(CONTEXT_AXIS) == 1:
        return value
    rows = math.prod(layout.size(a) for a in layout.batch_axes)
    if not isinstance(value, jax.Array) or value.ndim < 2 or value.shape[1] != layout.sequence \
            or value.shape[0] % rows:
        return value
    spec = P(layout.batch_axes or None, CONTEXT_AXIS)
    return jax.lax.with_sharding_constraint(value, NamedSharding(layout.mesh, spec))


_CURRENT: list[MeshLayout] = []


@contextlib.contextmanager
def laid_out(layout: MeshLayout) -> Iterator[None]:
    _CURRENT.append(layout)
    try:
        yield
    finally:
        _CURRENT.pop()


def current() -> MeshLayout | None:
    return _CURRENT[-1] if _CURRENT else None
