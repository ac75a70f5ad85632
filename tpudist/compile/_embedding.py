"""`tpudist.ShardedEmbedding`: embedding tables whose rows are split over one mesh axis.

    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})
    emb = tpudist.ShardedEmbedding(1_000_000, 64, mesh=mesh, axis="model")
    table = emb.init(jax.random.key(0))      # (1_000_000 padded to a multiple of 2, 64), rows over "model"
    vectors = emb(table, ids)                # inside jax.jit / tpudist.compile: ids.shape + (64,)

Several tables (DLRM has 26) are one `ShardedEmbedding([n_0, n_1, ...], F)`: they are stacked in
one array and looked up with one set of collectives, not one per table. The lookup algorithms are
described in `tpudist/compile/_lookup.py` and docs/mesh_and_compile.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist.compile import _lookup
from tpudist.compile._embedding_tables import init_table, shard_tables, unshard_table
from tpudist.compile._lookup import ALGORITHMS, Layout

COMBINERS = (None, "sum", "mean")


def _varying_axes(x: Any) -> frozenset:
    """The manual mesh axes `x` varies over inside shard_map (empty when unknown)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


class ShardedEmbedding:
    """One or several embedding tables, rows split over mesh axis `axis`; lookup by id.

    `num_embeddings` is a table's row count, or a sequence of row counts for several tables of the
    same `features` looked up together. Each table is padded up to a multiple of the axis size
    (padding rows are zero, never looked up, and get no gradient); `shape` is the stacked global
    array's shape and `sharding` its `NamedSharding` (rows over `axis`, replicated over the other
    axes).

    `emb(table, ids)` runs inside `jax.jit` or `tpudist.compile` (global view), or inside a
    per-device step (`tpudist.compile(..., per_device=True)` / `jax.shard_map`), where `table` is
    this device's block. Ids are integers:

    - one table: ids of any shape -> `ids.shape + (features,)`, equal to a dense `table[ids]`;
    - several: ids `(..., T)` -> `(..., T, features)`, column t looked up in table t;
    - with `combiner="sum"` or `"mean"` the last dim of ids is a bag of ids per example, combined
      as `torch.nn.EmbeddingBag` does: `(..., L) -> (..., features)`, `(..., T, L) -> (..., T, F)`.

    Ids outside `[0, num_embeddings)` (use -1 to pad ragged bags) give a zero vector, are not
    counted by "mean" and get no gradient. The backward pass is JAX autodiff: the gradient of the
    table has the table's sharding; no device ever holds the whole table or its whole gradient.

    `algorithm` picks the lookup ("psum", "psum_scatter", "all_to_all", or "auto"): see
    docs/mesh_and_compile.md for what each moves and the measured trade-off. "auto" uses
    "psum_scatter" when the batch (the first dim of ids) splits over every device, else "psum";
    an algorithm that needs the batch split falls back to "psum" when it does not divide.
    Example::

        emb = tpudist.ShardedEmbedding([1000, 50, 7], 16, mesh=mesh, axis="model")
        table = emb.init(jax.random.key(0))
        step = tpudist.compile(lambda t, ids: emb(t, ids).sum(), mesh=mesh, in_specs=(None, P("data")))
    """

    def __init__(self, num_embeddings: int | Sequence[int], features: int, *, mesh: Any,
                 axis: str = "model", combiner: str | None = None, algorithm: str = "auto",
                 dtype: Any = jnp.float32):
        self.single = isinstance(num_embeddings, (int, np.integer))
        sizes = (num_embeddings,) if self.single else tuple(num_embeddings)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
                            for n in sizes):
            raise ValueError(f"num_embeddings must be a positive int or a non-empty sequence of them, "
                             f"got {num_embeddings!r}")
        if isinstance(features, bool) or not isinstance(features, (int, np.integer)) or features < 1:
            raise ValueError(f"features must be a positive int, got {features!r}")
        axis = str(axis)
        if axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {axis!r} to shard the table over; its axes are "
                             f"{list(mesh.axis_names)}")
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
        if algorithm not in ALGORITHMS + ("auto",):
            raise ValueError(f"algorithm must be one of {ALGORITHMS + ('auto',)}, got {algorithm!r}")
        self.features = int(features)
        self.mesh = mesh
        self.axis = axis
        self.combiner = combiner
        self.algorithm = algorithm
        self.dtype = dtype
        self.layout = Layout(tuple(int(n) for n in sizes), int(mesh.shape[axis]))
        self.sharding = NamedSharding(mesh, P(axis, None))

    @property
    def num_embeddings(self) -> int | tuple[int, ...]:
        return self.layout.sizes[0] if self.single else self.layout.sizes

    @property
    def shape(self) -> tuple[int, int]:
        """The global table array's shape: (axis size * rows per device, features)."""
        return (self.layout.shards * self.layout.block_rows, self.features)

    def __repr__(self) -> str:
        return (f"ShardedEmbedding({self.num_embeddings}, {self.features}, axis={self.axis!r}, "
                f"shards={self.layout.shards}, combiner={self.combiner!r}, algorithm={self.algorithm!r})")

    # -- creating and reading tables -------------------------------------------------------------

    def init(self, key: jax.Array) -> jax.Array:
        """A fresh table, generated on each device for its own rows only.

        Values are uniform in `[-1/sqrt(n_t), 1/sqrt(n_t))` for table t (DLRM's initialisation),
        a counter-based hash of `(key, t, row, feature)`: they depend on the key, never on the
        mesh, so a 1-device and an 8-device run start from the same table. `key` is a
        `jax.random.key` or a raw uint32 key.
        """
        return init_table(self.mesh, self.axis, self.layout, self.features, self.dtype, key)

    def shard(self, tables: Any) -> jax.Array:
        """The global table array from host numpy table(s) that every process holds.

        Each device copies only its own rows. `tables` is one (n, F) array, or a list of them for
        several tables. Use it to load a checkpoint or to start from known values.
        """
        tables = [np.asarray(tables)] if self.single else [np.asarray(t) for t in tables]
        return shard_tables(tables, self.layout, self.features, self.sharding, self.dtype)

    def unshard(self, table: jax.Array) -> Any:
        """The table(s) as host numpy arrays without padding, on every process.

        This gathers the whole table to every process: for tests, debugging and exporting tables
        that fit in host memory, not for the training loop.
        """
        tables = unshard_table(table, self.layout, self.shape)
        return tables[0] if self.single else tables

    # -- lookup ----------------------------------------------------------------------------------

    def __call__(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"ids must be integers, got {ids.dtype}")
        trailing = (0 if self.single else 1) + (self.combiner is not None)
        if ids.ndim < trailing:
            raise ValueError(f"ids of shape {ids.shape} lack the trailing dims "
                             f"{self._ids_layout()} this embedding expects")
        if not self.single and ids.shape[-1 - (self.combiner is not None)] != len(self.layout.sizes):
            raise ValueError(f"ids of shape {ids.shape} should be {self._ids_layout()} with "
                             f"T={len(self.layout.sizes)} tables")
        if self.axis in jax.sharding.get_abstract_mesh().manual_axes:
            return self._per_device(table, ids, trailing)
        if tuple(table.shape) != self.shape:
            raise ValueError(f"table has shape {tuple(table.shape)}, expected {self.shape}; create it "
                             "with emb.init(key) or emb.shard(numpy_table)")
        return self._global(table, ids, trailing)

    def _ids_layout(self) -> str:
        dims = "..." + ("" if self.single else ", T") + (", L" if self.combiner else "")
        return f"({dims})"

    def _to_core(self, ids: jax.Array) -> jax.Array:
        """Local ids -> (n, T, L)."""
        tables = len(self.layout.sizes)
        bag = ids.shape[-1] if self.combiner else 1
        return ids.reshape(-1, tables, bag)

    def _from_core(self, out: jax.Array, ids: jax.Array, trailing: int) -> jax.Array:
        prefix = ids.shape[: ids.ndim - trailing]
        return out.reshape(prefix + (() if self.single else (len(self.layout.sizes),)) + (self.features,))

    def _per_device(self, block: jax.Array, ids: jax.Array, trailing: int) -> jax.Array:
        if tuple(block.shape) != (self.layout.block_rows, self.features):
            raise ValueError(f"inside a per-device step the table is this device's block of shape "
                             f"{(self.layout.block_rows, self.features)}, got {tuple(block.shape)}; "
                             f"pass the table with in_spec P({self.axis!r})")
        # JAX types each value with the manual axes it varies over (shard_map's check_vma, on in
        # tpudist.compile(per_device=True)): the same ids on every device of the axis need only
        # a psum; different ids need the algorithms that exchange them.
        if self.axis not in _varying_axes(ids):
            algorithm = "psum"
        elif self.algorithm == "psum":
            raise ValueError(f"algorithm='psum' needs the same ids on every device of axis "
                             f"{self.axis!r}, but these ids vary over it")
        else:
            algorithm = "all_to_all" if self.algorithm == "all_to_all" else "psum_scatter"
        out = _lookup.per_device(algorithm, block, self._to_core(ids), self.layout,
                                 self.axis, self.combiner)
        return self._from_core(out, ids, trailing)

    def plan(self, batch: int | None) -> tuple[str, tuple[str, ...]]:
        """(algorithm, mesh axes the batch dim is split over) for a global batch of `batch` rows."""
        others = tuple(a for a in self.mesh.axis_names if a != self.axis and self.mesh.shape[a] > 1)
        data = math.prod(self.mesh.shape[a] for a in others)
        shards = self.layout.shards
        if batch is None:
            return "psum", ()
        # "auto" picks by bytes: a reduce-scatter moves half of what an all-reduce does and leaves
        # the rest of the step split over every device. On CPU the two measure within noise of
        # each other (scripts/bench_embedding.py), so nothing overrules that.
        wants_split = shards > 1 and self.algorithm != "psum"
        if wants_split and batch % (data * shards) == 0:
            return ("psum_scatter" if self.algorithm == "auto" else self.algorithm), others + (self.axis,)
        return "psum", (others if batch % data == 0 else ())

    def _global(self, table: jax.Array, ids: jax.Array, trailing: int) -> jax.Array:
        batch = ids.shape[0] if ids.ndim > trailing else None
        algorithm, batch_axes = self.plan(batch)
        split = batch_axes if batch_axes else None
        ids_spec = P(split, *([None] * (ids.ndim - 1))) if ids.ndim else P()
        out_ndim = ids.ndim - trailing + (0 if self.single else 1) + 1
        out_spec = P(split, *([None] * (out_ndim - 1))) if batch is not None else P()

        def body(block: jax.Array, local_ids: jax.Array) -> jax.Array:
            out = _lookup.per_device(algorithm, block, self._to_core(local_ids), self.layout,
                                     self.axis, self.combiner)
            return self._from_core(out, local_ids, trailing)

        # Size-1 axes stay automatic: a manual one would still all-reduce the table gradient
        # over it, a table-block-sized temporary for nothing.
        manual = {a for a in self.mesh.axis_names if self.mesh.shape[a] > 1} | {self.axis}
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(self.axis, None), ids_spec),
                             out_specs=out_spec, axis_names=manual)(table, ids)

