"""A compiled JAX step's arguments as global `jax.Array`s on its mesh, so that every process may pass
either a global array already on the mesh (used as it is) or only its own local part (assembled)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def is_spec(x: Any) -> bool:
    """Whether `x` is one entry of `in_specs` / `out_specs` (a PartitionSpec, or None), not a tree of them."""
    return x is None or isinstance(x, P)


def globalize(name: str, mesh: Any, mesh_devices: frozenset, in_specs: Any, index: int, arg: Any) -> Any:
    """Argument `index` of step `name` with every leaf a global array on `mesh` (whose devices are
    `mesh_devices`), laid out by its `in_specs` entry; errors name the rank, the step and the leaf."""
    spec_tree = in_specs if in_specs is None or is_spec(in_specs) else in_specs[index]

    def convert(path: Any, leaf: Any, spec: P | None) -> jax.Array:
        try:
            return _to_global(mesh, mesh_devices, leaf, spec)
        except (ValueError, TypeError) as e:
            where = f"argument {index}{jax.tree_util.keystr(path)}"
            raise type(e)(f"rank {jax.process_index()}: {name}: {where} "
                          f"(shape {np.shape(leaf)}, spec {spec}): {e}") from e

    def per_subtree(spec: P | None, subtree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda p, leaf: convert(p, leaf, spec), subtree)

    if is_spec(spec_tree):
        return per_subtree(spec_tree, arg)
    try:
        return jax.tree_util.tree_map(per_subtree, spec_tree, arg, is_leaf=is_spec)
    except ValueError as e:
        raise ValueError(f"{name}: in_specs[{index}] must be a PartitionSpec, None, or a tree "
                         f"of them that is a prefix of argument {index}'s structure: {e}") from e


def _to_global(mesh: Any, mesh_devices: frozenset, leaf: Any, spec: P | None) -> jax.Array:
    if (isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
            and leaf.sharding.device_set == mesh_devices):
        if spec is None:
            return leaf
        target = NamedSharding(mesh, spec)
        if leaf.sharding.is_equivalent_to(target, leaf.ndim):
            return leaf
        return jax.device_put(leaf, target)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        raise ValueError("this global array lives on devices outside the step's mesh; build it on "
                         "the same mesh, or pass this process's local part as numpy")
    data = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec or P()), data)
