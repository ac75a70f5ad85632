"""Small helpers shared by the op families: dim normalization, argument checks, torch's sign and
float promotion."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import UnsupportedOpError, register


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


def register_unary(op: Any, fn: Callable[[Any], Any]) -> None:
    """Registers `fn` of one tensor as `op`'s lowering (through a closure, so a loop can register many)."""
    register(op)(lambda x: fn(x))


def torch_sign(x: Any) -> Any:
    """torch's sign: 0 for NaN (jnp.sign's is NaN), with no gradient."""
    return lax.stop_gradient(jnp.where(jnp.isnan(x), 0, jnp.sign(x)))


def float_arrays(*xs: Any) -> Any:
    """The arguments as float arrays of one shape (integer tensors compute in float32, as in torch)."""
    dtype = jnp.result_type(*xs)
    dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    out = jnp.broadcast_arrays(*(jnp.asarray(x, dtype) for x in xs))
    return out if len(out) > 1 else out[0]


def in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` computed with its bfloat16 / float16 arguments upcast to float32, as torch's kernels
    compute norms, softmax and reductions of half tensors ("opmath"); the interpreter casts each
    result back to the dtype torch recorded, so each op rounds once."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()})
    return wrapped


def _up(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_up(v) for v in value)
    if getattr(value, "dtype", None) in (jnp.bfloat16, jnp.float16) and hasattr(value, "astype"):
        return value.astype(jnp.float32)
    return value
