"""Crossing between user values (torch tensors, numpy arrays, jax arrays, Python scalars, and
lists / tuples / dicts of them) and the per-process XLA buffers the collectives run on.

torch tensors cross through DLPack without a copy in both directions; numpy results are copied
once so that the caller gets an ordinary writable array.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import jax
import numpy as np

from tpudist._buffers import DTYPES, numpy_view, torch_dtypes, torch_view
from tpudist._jaxcompat import import_buffer

# Python scalar type -> the numpy dtype it travels as (the result converts back to the Python type).
_SCALARS = {bool: np.bool_, int: np.int64, float: np.float64}

SUPPORTED_DTYPES = tuple(DTYPES[name] for name in (
    "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool", "bfloat16"))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array-like of the user's input: how it came in, so the result goes back the same way."""

    kind: str  # "torch", "numpy", "numpy_scalar", "jax", "scalar"
    shape: tuple[int, ...]
    dtype: np.dtype
    py_type: type | None = None  # for "scalar": bool, int or float
    torch_dtype: Any = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def torch_module() -> Any:
    """torch, if the program has imported it (tpudist never imports it for the user)."""
    return sys.modules.get("torch")


def fingerprint(x: Any) -> tuple[Any, ...]:
    """Everything `describe` reads of a leaf, cheap and hashable: (kind, type, dtype, shape,
    layout). `describe(x)` is computed from it alone, so a cache keyed by it (the collectives'
    repeat path) cannot serve a value that `describe` would classify differently."""
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch", type(x), x.dtype, x.shape, x.layout
    if isinstance(x, jax.Array):
        return "jax", type(x), x.dtype, x.shape, None
    if isinstance(x, np.ndarray):
        return "numpy", type(x), x.dtype, x.shape, None
    if isinstance(x, np.generic):
        return "numpy_scalar", type(x), x.dtype, (), None
    return "scalar", type(x), None, (), None


def describe(x: Any) -> Leaf:
    """Classifies one leaf; TypeError for what the collectives do not take."""
    return _describe(*fingerprint(x))


@functools.lru_cache(maxsize=1024)
def _describe(kind: str, cls: type, dtype: Any, shape: tuple[int, ...], layout: Any) -> Leaf:
    if kind == "torch":
        torch = torch_module()
        if layout == torch.sparse_coo or dtype.is_complex:
            raise TypeError(f"tpudist collectives take dense real tensors, got {layout} {dtype}")
        known = torch_dtypes().get(dtype)
        return Leaf("torch", tuple(shape), _checked(np.dtype(object if known is None else known), dtype, cls),
                    torch_dtype=dtype)
    if kind != "scalar":
        return Leaf(kind, shape, _checked(np.dtype(dtype), dtype, cls))
    if cls in _SCALARS:
        return Leaf("scalar", (), np.dtype(_SCALARS[cls]), py_type=cls)
    raise TypeError(f"tpudist collectives take torch tensors, numpy arrays, jax arrays, Python "
                    f"scalars, or lists/tuples/dicts of them; got {cls.__name__}")


def _checked(dtype: np.dtype, got: Any, cls: type) -> np.dtype:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
        raise TypeError(f"dtype {got} of a {cls.__name__} is not supported by tpudist "
                        f"collectives; use one of: {names}")
    return dtype


def to_block(x: Any, leaf: Leaf, device: Any) -> jax.Array:
    """The leaf as a (1, 1, *shape) buffer on `device`: the block this process contributes.

    CPU torch tensors and numpy arrays are wrapped without a copy (XLA only reads them, and the
    collective has finished before the caller gets control back).
    """
    block_shape = (1, 1) + leaf.shape
    if leaf.kind == "jax":
        return jax.device_put(x.reshape(block_shape), device)
    if leaf.kind == "torch":
        host = x.detach()
        if host.device.type != "cpu":
            host = host.cpu()
        host = host.contiguous().reshape(block_shape)
    else:
        host = np.ascontiguousarray(np.asarray(x, dtype=leaf.dtype)).reshape(block_shape)
    arr = import_buffer(host, device) if device.platform == "cpu" else None
    if arr is None:
        arr = jax.device_put(jax.dlpack.from_dlpack(host) if leaf.kind == "torch" else host, device)
    return arr


def host_block(x: Any, leaf: Leaf) -> np.ndarray:
    """The leaf's values as a (1, 1, *shape) host array: a view where the input allows (CPU
    tensors, contiguous numpy arrays), for the engine to copy into its staging buffers."""
    block_shape = (1, 1) + leaf.shape
    if leaf.kind == "torch":
        return flat_numpy(x, leaf).reshape(block_shape)
    return np.ascontiguousarray(np.asarray(x, dtype=leaf.dtype)).reshape(block_shape)


def from_block(block: jax.Array, leaf: Leaf, shape: tuple[int, ...], copy: bool = False) -> Any:
    """Converts this process's result block back to the leaf's kind, with the result's shape.

    torch results share XLA's buffer (DLPack) unless `copy`, which suits small results: a copy of
    a few KiB costs less than the DLPack exchange.
    """
    if leaf.kind == "torch":
        torch = torch_module()
        if copy:
            return torch_view(np.array(block).reshape(shape))
        return torch.from_dlpack(block).reshape(shape)
    if leaf.kind == "jax":
        return block.reshape(shape)
    out = np.array(block).reshape(shape)  # a copy: XLA's buffer is read-only to numpy
    if leaf.kind == "numpy_scalar":
        return out[()]
    if leaf.kind == "scalar":
        return leaf.py_type(out[()])
    return out


def flat_numpy(x: Any, leaf: Leaf) -> np.ndarray:
    """The leaf's values as a flat host array (a view where the input allows, e.g. CPU tensors)."""
    if leaf.kind == "torch":
        return numpy_view(x.detach().cpu().contiguous().reshape(-1))
    return np.asarray(x, dtype=leaf.dtype).reshape(-1)


def from_flat(flat: np.ndarray, leaf: Leaf) -> Any:
    """The inverse of `flat_numpy`: a result slice back to the leaf's kind and shape (no copy)."""
    shaped = flat.reshape(leaf.shape)
    if leaf.kind == "torch":
        return torch_view(shaped)
    if leaf.kind == "jax":
        return jax.numpy.asarray(shaped)
    if leaf.kind == "numpy_scalar":
        return shaped[()]
    if leaf.kind == "scalar":
        return leaf.py_type(shaped[()])
    return shaped
