"""A `ShardedEmbedding`'s table arrays, made and read back: generated or copied from numpy on each
device for its own rows only, so that no device (and no host) ever holds the whole table."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist.compile import _lookup
from tpudist.compile._lookup import Layout


def init_table(mesh: Any, axis: str, layout: Layout, features: int, dtype: Any, key: jax.Array) -> jax.Array:
    """A fresh global table, rows over `axis`, each device generating its own block (`_lookup.init_block`)."""
    return _init_fn(mesh, axis, layout, features, dtype)(key)


@functools.lru_cache(maxsize=64)
def _init_fn(mesh: Any, axis: str, layout: Layout, features: int, dtype: Any) -> Any:
    body = functools.partial(_lookup.init_block, layout=layout, features=features, axis=axis, dtype=dtype)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(axis, None)))


def shard_tables(tables: list[np.ndarray], layout: Layout, features: int, sharding: NamedSharding,
                 dtype: Any) -> jax.Array:
    """The global table array laid out by `sharding` from every table's host copy; each device
    copies only its own rows. ValueError when a table's shape is not (its rows, `features`)."""
    expected = [(n, features) for n in layout.sizes]
    if [t.shape for t in tables] != expected:
        raise ValueError(f"tables have shapes {[t.shape for t in tables]}, expected {expected}")
    block = layout.block_rows
    shape = (layout.shards * block, features)

    def piece(index: tuple[slice, ...]) -> np.ndarray:
        start = index[0].start or 0
        assert (index[0].stop or shape[0]) - start == block, (index, block)
        rows = np.concatenate(_lookup.block_rows_of(tables, layout, start // block))
        return rows.astype(dtype)[:, index[1]]

    return jax.make_array_from_callback(shape, sharding, piece)


def unshard_table(table: jax.Array, layout: Layout, shape: tuple[int, int]) -> list[np.ndarray]:
    """Every table of the global `table` (of `shape`) as a host numpy array without padding, on
    every process: a gather of the whole table, for tests, debugging and export."""
    from jax.experimental import multihost_utils
    if tuple(table.shape) != shape:
        raise ValueError(f"table has shape {tuple(table.shape)}, expected {shape}")
    full = np.asarray(multihost_utils.process_allgather(table, tiled=True))
    blocks = full.reshape(layout.shards, layout.block_rows, -1)
    out = []
    for n, r, off in zip(layout.sizes, layout.shard_rows, layout.offsets):
        out.append(blocks[:, off:off + r].reshape(-1, blocks.shape[-1])[:n])
    return out
