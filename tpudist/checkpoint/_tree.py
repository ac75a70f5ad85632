"""Between the pytrees users hand to `tpudist.checkpoint` and the trees orbax stores.

A state is any pytree whose leaves are `jax.Array`s (global, sharded or not), numpy arrays and
scalars, Python numbers, bools and strings, or torch tensors (so a `model.state_dict()` or an
`optimizer.state_dict()` is a state as it is). On the way in, torch tensors and numpy scalars become
numpy arrays, and a process-local jax array in a multi-process job (one that lives on this process's
devices only, e.g. an optimizer's step count created outside a compiled step) becomes numpy too:
orbax writes such host values once, from process 0. On the way out each leaf takes the kind,
dtype and sharding of the matching leaf of `like`.

Before anything is read, `check(metadata, like)` compares the checkpoint's tree (orbax's
metadata) with `like`: the same keys, and for arrays the same shapes and dtypes. Orbax's own
restore would pad or truncate an array of another shape; tpudist refuses instead.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# Shown for at most this many keys in a mismatch error.
_SHOWN = 5


def _torch() -> Any:
    """torch, when the program has imported it (never imported here just to look)."""
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_to_numpy(t: Any) -> np.ndarray:
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; ml_dtypes (a jax dependency) does
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _numpy_to_tensor(a: np.ndarray, like: Any) -> Any:
    torch = _torch()
    a = np.ascontiguousarray(a)
    if like.dtype == torch.bfloat16:
        out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(a)
    return out.to(like.device)


def _is_local_array(x: Any) -> bool:
    """A jax array on this process's devices only, in a job of several processes."""
    return isinstance(x, jax.Array) and jax.process_count() > 1 and x.is_fully_addressable


def key_name(path: tuple[str, ...]) -> str:
    """'params/w' for the key path ('params', 'w'), as errors show it."""
    return "/".join(path) or "(the root)"


def _leaf_error(path: Any, leaf: Any) -> TypeError:
    return TypeError(f"state{jax.tree_util.keystr(path)}: cannot checkpoint a {type(leaf).__name__}; "
                     "leaves are jax or numpy arrays, Python or numpy scalars, strings, or torch "
                     "tensors")


def storable(state: Any, copy: bool) -> Any:
    """`state` with every leaf in a form orbax saves; host arrays copied when `copy` (an
    asynchronous save writes them after `save` has returned, while the caller may change them)."""

    def convert(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            return np.array(leaf) if _is_local_array(leaf) else leaf
        if _is_tensor(leaf):
            out = _tensor_to_numpy(leaf)
            return out.copy() if copy else out
        if isinstance(leaf, np.ndarray):
            return leaf.copy() if copy else leaf
        if isinstance(leaf, np.generic):
            return np.asarray(leaf)
        if isinstance(leaf, (bool, int, float, str)):
            return leaf
        raise _leaf_error(path, leaf)

    return jax.tree_util.tree_map_with_path(convert, state)


# -- restoring ------------------------------------------------------------------------------------

def _describe(leaf: Any) -> str:
    """`float32[1000, 64]` for arrays (and array metadata), else the kind of value."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if isinstance(leaf, ocp.metadata.StringMetadata) or isinstance(leaf, str):
        return "a string"
    if isinstance(leaf, ocp.metadata.ScalarMetadata) or isinstance(leaf, (bool, int, float)):
        return f"a {getattr(dtype, 'name', type(leaf).__name__)} scalar"
    if shape is not None and dtype is not None:
        return f"{np.dtype(dtype).name}{list(shape)}"
    return type(leaf).__name__


def _is_array_like(leaf: Any) -> bool:
    return (isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))
            or _is_tensor(leaf))


def _expected_dtype(leaf: Any) -> np.dtype:
    if _is_tensor(leaf):
        return _tensor_to_numpy(leaf.detach().new_empty((0,))).dtype
    return np.dtype(leaf.dtype)


def check(metadata: Any, like: Any, where: str) -> None:
    """Raises ValueError naming `where`, the key and both sides when the checkpoint's tree
    (orbax's metadata tree) is not `like`'s: missing or extra keys, another shape or dtype, an
    array where like has a scalar or string (or the reverse)."""
    saved = ocp.tree.to_flat_dict(metadata)
    wanted = ocp.tree.to_flat_dict(like)
    missing = [key_name(k) for k in wanted if k not in saved]
    extra = [key_name(k) for k in saved if k not in wanted]
    problems = []
    if missing:
        problems.append(f"like has {_some(missing)} that the checkpoint lacks")
    if extra:
        problems.append(f"the checkpoint holds {_some(extra)} that like lacks")
    for key, want in wanted.items():
        have = saved.get(key)
        if have is None:
            continue
        name = key_name(key)
        if _is_array_like(want):
            if not isinstance(have, ocp.metadata.ArrayMetadata):
                problems.append(f"{name!r} is {_describe(have)} in the checkpoint but {_describe(want)} in like")
            elif tuple(have.shape) != tuple(want.shape) or np.dtype(have.dtype) != _expected_dtype(want):
                problems.append(f"{name!r} is {_describe(have)} in the checkpoint but "
                                f"{_expected_dtype(want).name}{list(want.shape)} in like")
        elif isinstance(want, str) != isinstance(have, ocp.metadata.StringMetadata) or (
                not isinstance(want, str) and not isinstance(have, ocp.metadata.ScalarMetadata)):
            problems.append(f"{name!r} is {_describe(have)} in the checkpoint but {_describe(want)} in like")
    if problems:
        shown = "; ".join(problems[:_SHOWN]) + (f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else "")
        raise ValueError(f"{where} does not match like (another model's checkpoint?): {shown}. "
                         "Nothing was loaded.")


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def restore_plan(like: Any) -> tuple[Any, Any]:
    """(the item, the restore arguments) that read a checkpoint into `like`'s shardings: each jax
    array leaf is read as its sharding lays it out, so a process reads only its own shards."""

    def item(leaf: Any) -> Any:
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and not _is_local_array(leaf):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        return leaf

    def args(leaf: Any) -> Any:
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and not _is_local_array(leaf):
            if leaf.sharding is None:
                raise ValueError("a jax.ShapeDtypeStruct in like needs a sharding (where to restore it)")
            return ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=tuple(leaf.shape),
                                        dtype=leaf.dtype, strict=True)
        if _is_array_like(leaf):
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.RestoreArgs(restore_type=str if isinstance(leaf, str) else None)

    return jax.tree.map(item, like), jax.tree.map(args, like)


def like_kinds(like: Any, restored: Any) -> Any:
    """`restored` with each leaf of the kind of `like`'s: torch tensors, numpy scalars, jax arrays
    on like's devices, Python numbers of like's type."""

    def convert(want: Any, got: Any) -> Any:
        if _is_tensor(want):
            return _numpy_to_tensor(np.asarray(got), want)
        if isinstance(want, np.generic):
            return np.asarray(got).astype(want.dtype)[()]
        if _is_local_array(want):
            return jax.device_put(np.asarray(got), want.sharding)
        if isinstance(want, (bool, int, float)):
            return type(want)(got)
        return got

    return jax.tree.map(convert, like, restored)


def block_until_ready(state: Any) -> None:
    """Waits for the jax arrays in `state`: on a CPU mesh a checkpoint's barriers must not overlap a
    step still running (overlapping multi-device executions deadlock in gloo; see _jax_step)."""
    jax.block_until_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
