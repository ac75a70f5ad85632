"""Ops that talk to other devices: `tpudist.nn.ShardedEmbedding`'s lookup.

They lower to in-graph collectives over the mesh axis of the program being traced, which its
builder announces with `over_axis`: the fused train step (axis "data" over every device), or a
compiled module's graph holding such an op (run over one device per process, see `_spmd`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from tpudist.compile._lookup import Layout, lookup_psum_scatter
from tpudist.compile._torch._custom_ops import SHARDED_EMBEDDING_LOOKUP
from tpudist.compile._torch.lowering._table import UnsupportedOpError, register

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
            "torch -> XLA: tpudist.nn.ShardedEmbedding's lookup reaches every process's rows; it lowers "
            "only inside a program over the processes (tpudist.compile(module), compile_train_step, fit)")
    axis, devices = where
    # device d holds rows [d * R, (d + 1) * R) of the padded table: one "table" of devices * R rows
    layout = Layout(sizes=(devices * block.shape[0],), shards=devices)
    out = lookup_psum_scatter(block, ids[:, None, :], layout, axis, None if mode == "none" else mode)
    return out[:, 0, :]
