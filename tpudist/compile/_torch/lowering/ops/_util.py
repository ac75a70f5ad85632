"""Small helpers shared by the op families: dim normalization, argument checks, torch's sign,
float promotion, and custom VJPs that hold inside shard_map."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from tpudist._jaxcompat import varying_axes
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


class custom_vjp:  # noqa: N801  (used as jax.custom_vjp is: a decorator, then .defvjp(fwd, bwd))
    """`jax.custom_vjp` that also holds inside shard_map (the fused train step).

    There every value carries the mesh axes it varies over, and JAX requires each cotangent a bwd
    rule returns to vary exactly as its primal input does. A bwd rule computes its cotangents from
    the output's cotangent, which varies wherever any input does, so an input that does not vary
    (a constant: the zeros `max_unpool` scatters into) gets a varying cotangent, and one computed
    without the output's cotangent (zeros) may vary too little. So the array arguments are made
    to vary alike before the call (outside the custom VJP, where JAX's autodiff transposes the cast
    into the sum over those axes, as for any op mixing such values), and each cotangent is made to
    vary over those axes too.

        @functools.partial(custom_vjp, nondiff_argnums=(1,))
        def f(x, axis): ...
        f.defvjp(f_fwd, f_bwd)   # the signatures jax.custom_vjp takes
    """

    def __init__(self, fn: Callable[..., Any], nondiff_argnums: tuple[int, ...] = ()):
        functools.update_wrapper(self, fn)
        self._nondiff = frozenset(nondiff_argnums)
        # the axes travel as one more static (nondiff) argument, first
        self._vjp = jax.custom_vjp(lambda axes, *args: fn(*args),
                                   nondiff_argnums=(0, *(i + 1 for i in nondiff_argnums)))

    def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        def backward(axes: tuple[str, ...], *rest: Any) -> tuple:
            cotangents = bwd(*rest)
            return jax.tree_util.tree_map(lambda c: _vary(c, axes), tuple(cotangents))
        self._vjp.defvjp(lambda axes, *args: fwd(*args), backward)

    def __call__(self, *args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in self._nondiff]
        axes = tuple(sorted(frozenset().union(*(varying_axes(x) for x in _arrays(dynamic)))))
        args = tuple(a if i in self._nondiff else jax.tree_util.tree_map(lambda x: _vary(x, axes), a)
                     for i, a in enumerate(args))
        return self._vjp(axes, *args)


def _arrays(tree: Any) -> list[Any]:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def _vary(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` marked as varying over `axes` (besides its own); anything but a numeric JAX array as it is."""
    if not axes or not isinstance(x, jax.Array):
        return x
    if not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):
        return x  # a float0 cotangent, a PRNG key
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x
