"""Ops that talk to other devices: `tpudist.nn.ShardedEmbedding`'s lookup.

They lower to in-graph collectives over the mesh axis of the step being traced, which the fused
train step announces with `over_axis`; anywhere else (a plain `tpudist.compile(module)`, whose
graph runs on each process alone) they are unsupported.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from tpudist.compile._lookup import Layout, lookup_psum_scatter
from tpudist.compile._torch._custom_ops import SHARDED_EMBEDDING_LOOKUP
from tpudist.compile._torch._registry import UnsupportedOpError, register

# (axis name, devices on it) while a fused step traces its per-device body; None otherwise
_AXIS: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("tpudist_torch_axis", default=None)


@contextlib.contextmanager
def over_axis(axis: str, devices: int) -> Iterator[None]:
    """Lower collective ops over mesh axis `axis` (of `devices` devices) inside this block."""
    token = _AXIS.set((axis, devices))
    try:
        yield
    finally:
        _AXIS.reset(token)


@register(SHARDED_EMBEDDING_LOOKUP)
def sharded_embedding_lookup(block, ids, mode):
    where = _AXIS.get()
    if where is None:
        raise UnsupportedOpError(
            "torch -> XLA: tpudist.nn.ShardedEmbedding's lookup reaches every process's rows, so it runs "
            "in eager torch or inside the fused train step (tpudist.compile_train_step, tpudist.fit); a "
            "plain tpudist.compile(module) runs each process's graph on its own")
    axis, devices = where
    # device d holds rows [d * R, (d + 1) * R) of the padded table: one "table" of devices * R rows
    layout = Layout(sizes=(devices * block.shape[0],), shards=devices)
    out = lookup_psum_scatter(block, ids[:, None, :], layout, axis, None if mode == "none" else mode)
    return out[:, 0, :]
