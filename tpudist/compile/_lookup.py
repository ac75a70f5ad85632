"""The per-device lookup algorithms behind `ShardedEmbedding` (run inside `jax.shard_map`).

Layout: T tables of `n_t` rows each are row-sharded over the M devices of one mesh axis. Table t is
padded to `M * R_t` rows (`R_t = ceil(n_t / M)`); device m holds rows `[m * R_t, (m + 1) * R_t)` of
every table, stacked one table after another, so its block has `S = sum(R_t)` rows and the global
array has `M * S` rows. Row r of table t lives on device `r // R_t` at block row
`offset_t + r % R_t`.

Every algorithm gets a local block of ids shaped (n, T, L) -- n examples, T tables, a bag of L ids
per table (L = 1 without a combiner) -- and returns the (n, T, F) embeddings, bags combined.
Ids outside `[0, n_t)` (padding, e.g. -1 in ragged bags) look up a zero row, are not counted by
"mean", and get no gradient. Autodiff differentiates through the gather and the collectives, so
a device's table gradient is the scatter-add of the cotangents of the ids it owns: its block's
size, never the full table.

- "psum": ids are the same on every device of the axis. Each device gathers the rows it owns
  (zeros elsewhere), combines bags, and `psum` over the axis adds the pieces. Moves (n, T, F)
  per device through an all-reduce; output is replicated over the axis.
- "psum_scatter": each device of the axis has its own ids. `all_gather` the ids (cheap ints),
  masked lookup of all M*n examples, combine bags, then `psum_scatter` returns each device only
  its own n examples: a reduce-scatter, half the bytes of an all-reduce, and the rest of the
  step stays split over the axis.
- "all_to_all": each device has its own ids and sends each id only to the device that owns its
  row, in per-owner buckets sized for the worst case (all ids to one owner, so no id is ever
  dropped); owners gather and return rows with a second `all_to_all`. Same bytes as
  "psum_scatter" at this capacity, bags are combined only after the return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

ALGORITHMS = ("psum", "psum_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every row of T row-sharded tables lives (see the module docstring)."""

    sizes: tuple[int, ...]  # n_t: rows of each table
    shards: int  # M: devices along the sharding axis

    @property
    def shard_rows(self) -> tuple[int, ...]:  # R_t
        return tuple(-(-n // self.shards) for n in self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:  # where table t starts inside a block
        out, acc = [], 0
        for r in self.shard_rows:
            out.append(acc)
            acc += r
        return tuple(out)

    @property
    def block_rows(self) -> int:  # S
        return sum(self.shard_rows)

    def locate(self, ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(owner device, block row, valid) of ids shaped (..., T, L)."""
        sizes = jnp.asarray(self.sizes, dtype=ids.dtype)[:, None]
        rows = jnp.asarray(self.shard_rows, dtype=ids.dtype)[:, None]
        offsets = jnp.asarray(self.offsets, dtype=ids.dtype)[:, None]
        valid = (ids >= 0) & (ids < sizes)
        safe = jnp.where(valid, ids, 0)
        return safe // rows, offsets + safe % rows, valid


def _combine(rows: jax.Array, valid: jax.Array, combiner: str | None) -> jax.Array:
    """(n, T, L, F) rows -> (n, T, F): bag sum / mean, or the single id of a bag of one."""
    if combiner is None:
        return rows[:, :, 0, :]
    total = rows.sum(axis=2)
    if combiner == "sum":
        return total
    count = jnp.maximum(valid.sum(axis=2, keepdims=True), 1).astype(rows.dtype)
    return total / count


def _masked_lookup(block: jax.Array, layout: Layout, ids: jax.Array, me: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """The rows of `ids` that this device owns, zeros for the others; also the ids' validity."""
    owner, row, valid = layout.locate(ids)
    mine = valid & (owner == me)
    rows = jnp.take(block, jnp.where(mine, row, 0), axis=0)
    return jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), valid


def lookup_psum(block: jax.Array, ids: jax.Array, layout: Layout, axis: str,
                combiner: str | None) -> jax.Array:
    rows, valid = _masked_lookup(block, layout, ids, jax.lax.axis_index(axis))
    return jax.lax.psum(_combine(rows, valid, combiner), axis)


def lookup_psum_scatter(block: jax.Array, ids: jax.Array, layout: Layout, axis: str,
                        combiner: str | None) -> jax.Array:
    everyone = jax.lax.all_gather(ids, axis, tiled=True)
    rows, valid = _masked_lookup(block, layout, everyone, jax.lax.axis_index(axis))
    return jax.lax.psum_scatter(_combine(rows, valid, combiner), axis, scatter_dimension=0, tiled=True)


def lookup_all_to_all(block: jax.Array, ids: jax.Array, layout: Layout, axis: str,
                      combiner: str | None) -> jax.Array:
    n, tables, bag = ids.shape
    owner, row, valid = layout.locate(ids)
    owner, row, flat_valid = owner.reshape(-1), row.reshape(-1), valid.reshape(-1)
    capacity = owner.shape[0]
    shards = layout.shards
    # Slot of each id inside its owner's bucket: how many earlier ids go to the same owner.
    one_hot = jax.nn.one_hot(owner, shards, dtype=jnp.int32)
    slot = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0) - 1, owner[:, None], axis=1)[:, 0]
    request = jnp.full((shards, capacity), -1, dtype=row.dtype)
    request = request.at[owner, slot].set(jnp.where(flat_valid, row, -1))
    asked = jax.lax.all_to_all(request, axis, 0, 0, tiled=True)  # [peer, slot]: rows peers want from me
    found = asked >= 0
    served = jnp.take(block, jnp.where(found, asked, 0), axis=0)
    served = jnp.where(found[..., None], served, jnp.zeros((), served.dtype))
    answered = jax.lax.all_to_all(served, axis, 0, 0, tiled=True)  # [owner, slot]: my rows back
    rows = answered[owner, slot].reshape(n, tables, bag, -1)
    return _combine(rows, valid, combiner)


_BY_NAME = {"psum": lookup_psum, "psum_scatter": lookup_psum_scatter, "all_to_all": lookup_all_to_all}


def per_device(algorithm: str, block: jax.Array, ids: jax.Array, layout: Layout, axis: str,
               combiner: str | None) -> jax.Array:
    """Runs `algorithm` on this device's block and ids (n, T, L) -> (n, T, F)."""
    return _BY_NAME[algorithm](block, ids, layout, axis, combiner)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def init_block(key: jax.Array, layout: Layout, features: int, axis: str, dtype: Any) -> jax.Array:
    """This device's block of freshly initialised tables, (S, F).

    Element (r, f) of table t is uniform in `[-1/sqrt(n_t), 1/sqrt(n_t))` (DLRM's initialisation),
    computed by a counter-based hash of (key, t, r, f): a table's values depend on the key only,
    never on the mesh, and each device computes just its own rows with a few integer ops (a
    threefry circuit per row compiles slowly and costs more on CPU). Padding rows are zero.
    """
    import numpy as np
    table_of = np.concatenate([np.full(r, t) for t, r in enumerate(layout.shard_rows)])
    within = np.concatenate([np.arange(r) for r in layout.shard_rows])
    rows_per_shard = np.asarray(layout.shard_rows)[table_of]
    sizes = np.asarray(layout.sizes)[table_of]
    bounds = (1.0 / np.sqrt(sizes)).astype(np.float32)
    rows = jax.lax.axis_index(axis) * jnp.asarray(rows_per_shard) + jnp.asarray(within)

    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    seed = jnp.uint32(0x9E3779B9)
    for word in jnp.ravel(words).astype(jnp.uint32):
        seed = _mix(seed ^ word)
    h = _mix(seed ^ _mix(jnp.asarray(table_of, jnp.uint32) + jnp.uint32(0x68E31DA4)))
    h = _mix(h ^ _mix(rows.astype(jnp.uint32) + jnp.uint32(0xB5297A4D)))
    h = _mix(h[:, None] ^ _mix(jnp.arange(features, dtype=jnp.uint32) + jnp.uint32(0x1B56C4E9)))
    unit = (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -23) - 1.0  # [-1, 1)
    values = (unit * jnp.asarray(bounds)[:, None]).astype(dtype)
    return jnp.where((rows < jnp.asarray(sizes))[:, None], values, jnp.zeros((), dtype))


def block_rows_of(tables: Sequence[Any], layout: Layout, shard: int) -> list[Any]:
    """Host side: the rows of each (numpy) table that device `shard` holds, padded with zeros."""
    import numpy as np
    out = []
    for table, n, r in zip(tables, layout.sizes, layout.shard_rows):
        part = np.zeros((r,) + table.shape[1:], dtype=table.dtype)
        chunk = table[shard * r: min(n, (shard + 1) * r)]
        part[: chunk.shape[0]] = chunk
        out.append(part)
    return out
