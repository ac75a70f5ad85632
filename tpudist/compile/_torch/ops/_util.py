"""Small helpers shared by the op families: dim normalization and argument checks."""

from __future__ import annotations

from typing import Sequence

from tpudist.compile._torch._registry import UnsupportedOpError


def dim(d: int, ndim: int) -> int:
    """A non-negative dim for a tensor of rank `ndim`; torch treats a rank-0 tensor as rank 1 here."""
    return d % max(ndim, 1)


def dims(ds: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Reduction dims as a tuple; None or [] means every dim, as in ATen's `dim=[]` overloads."""
    if ds is None:
        return tuple(range(ndim))
    if isinstance(ds, int):
        ds = [ds]
    if len(ds) == 0:
        return tuple(range(ndim))
    return tuple(sorted({dim(d, ndim) for d in ds})) if ndim else ()


def unsupported_arg(op: str, what: str) -> UnsupportedOpError:
    """The error for an op whose arguments take a value the lowering does not implement."""
    return UnsupportedOpError(f"torch -> XLA: {op} with {what} has no XLA lowering")
