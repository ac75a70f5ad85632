"""The collectives as functions of one value over a named mesh axis (usable inside jit/shard_map).

The eager collectives run these over the engine's slot axis; `tpudist.all_reduce(x, axis="data")`
inside a compiled step runs them over a user mesh axis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax

REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


_GUARD: list[jax.Array] = []  # the eager collectives' agreement flag while their body is traced (`guarded`)


@contextlib.contextmanager
def guarded(agree: jax.Array) -> Iterator[None]:
    """While tracing a collective's body: every exchange between participants runs only where
    `agree` (a flag equal in every participant) holds, and gives zeros without moving data where it
    does not. The local arithmetic around the exchanges stays outside the condition, where XLA
    parallelises it (a 4 MiB sum inside a `lax.cond` took ~0.6 ms longer on XLA:CPU)."""
    _GUARD.append(agree)
    try:
        yield
    finally:
        _GUARD.pop()


def _move(exchange: Callable[..., jax.Array], x: jax.Array, *args, **kwargs) -> jax.Array:
    """`exchange(x, *args, **kwargs)`, a communication primitive, under the guard if one is set."""
    if not _GUARD:
        return exchange(x, *args, **kwargs)
    out = jax.eval_shape(lambda v: exchange(v, *args, **kwargs), x)
    return lax.cond(_GUARD[-1], lambda v: exchange(v, *args, **kwargs),
                    lambda v: jnp.zeros(out.shape, out.dtype), x)


def _wire(x: jax.Array) -> jax.Array:
    """A dtype every CPU collective implementation moves: bool travels as uint8."""
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


def _empty(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # XLA rejects collectives on zero-sized operands; an empty result needs no communication.
    return jnp.zeros(shape, x.dtype)


def _partners(size: int, step: int) -> list[tuple[int, int]]:
    return [(i, i ^ step) for i in range(size)]


_COMBINE = {"sum": jnp.add, "mean": jnp.add, "prod": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum}


def reduce(x: jax.Array, op: str, axis: str, size: int, scale: float = 1.0,
           exchange: str = "native") -> jax.Array:
    """All-reduce of `x` over `axis` (of `size` participants).

    exchange="native" is XLA's all-reduce (on CPU, gloo's ring: 2 * (size - 1) dependent message
    steps); "doubling" (`size` a power of two) is recursive doubling: log2(size) steps, in each of
    which participant i swaps its partial result with participant i ^ 2**k (one collective-permute)
    and combines the two. Every participant combines the same two operands in each step, and the
    ops are commutative, so all of them end with bit-identical results.
    """
    dtype = x.dtype
    if x.size == 0:
        return _empty(x, x.shape)
    if exchange == "doubling":
        out = x.astype(jnp.float32) if dtype in _LOW_PRECISION and op not in ("max", "min") else _wire(x)
        step = 1
        while step < size:
            out = _COMBINE[op](out, _move(lax.ppermute, out, axis, perm=_partners(size, step)))
            step *= 2
        if op == "mean":
            out = out / size
        out = out.astype(dtype)
    elif op == "prod":
        out = jnp.prod(_move(lax.all_gather, x, axis), axis=0).astype(dtype)
    elif dtype == jnp.bool_:
        out = _move(lax.pmax if op == "max" else lax.pmin, _wire(x), axis).astype(dtype)
    elif op in ("max", "min"):
        out = _move(lax.pmax if op == "max" else lax.pmin, x, axis)
    else:
        # Half-precision sums accumulate in float32, as torch's reductions do.
        wide = x.astype(jnp.float32) if dtype in _LOW_PRECISION else x
        out = _move(lax.psum, wide, axis)
        if op == "mean":
            out = out / size
        out = out.astype(dtype)
    if scale != 1.0:
        out = (out * jnp.asarray(scale, dtype)).astype(dtype)
    return out


def gather(x: jax.Array, dim: int, axis: str, exchange: str = "native") -> jax.Array:
    """All-gather along tensor dimension `dim` (a 0-d value gathers into shape (size,)).

    exchange="doubling" (a power-of-two number of participants): log2(size) collective-permute
    steps, each swapping the blocks gathered so far with participant i ^ 2**k, instead of XLA's
    all-gather (on CPU, gloo's ring of size - 1 steps); "all_to_all": one all-to-all of `size`
    copies of the block, so that every participant sends its block to every other at once. The
    same bytes move in all three.
    """
    if x.size == 0:
        return _empty(x, x.shape[:dim] + (x.shape[dim] * lax.psum(1, axis),) + x.shape[dim + 1:])
    if exchange in ("all_to_all", "doubling"):
        size = lax.psum(1, axis)
        block = _wire(x if x.ndim else x.reshape(1))
        if exchange == "all_to_all":
            received = _move(lax.all_to_all, jnp.broadcast_to(block, (size,) + block.shape), axis, 0, 0)
            # (size, *shape): participant j's block at j; concatenated along `dim` in that order
            out = jnp.moveaxis(received, 0, dim).reshape(
                block.shape[:dim] + (size * block.shape[dim],) + block.shape[dim + 1:])
            return out.astype(x.dtype)
        position = lax.axis_index(axis)
        out, step = block, 1
        while step < size:
            other = _move(lax.ppermute, out, axis, perm=_partners(size, step))
            # the participant with bit `step` clear holds the lower-ranked half
            out = jnp.where((position & step) == 0, jnp.concatenate([out, other], dim),
                            jnp.concatenate([other, out], dim))
            step *= 2
        return out.astype(x.dtype)
    if x.ndim == 0:
        return _move(lax.all_gather, _wire(x), axis).astype(x.dtype)
    return _move(lax.all_gather, _wire(x), axis, axis=dim, tiled=True).astype(x.dtype)


def reduce_scatter(x: jax.Array, op: str, dim: int, axis: str, size: int, scale: float = 1.0,
                   exchange: str = "native") -> jax.Array:
    """Reduces over `axis` and leaves participant i with chunk i of dimension `dim`.

    exchange="native" uses XLA's reduce-scatter for sums; "all_to_all" exchanges chunks with an
    all-to-all and reduces the received chunks locally; "halving" (`size` a power of two) is
    recursive halving: log2(size) collective-permutes, in each of which participant i keeps the half
    of its remaining chunks that holds chunk i, sends the other half to participant i ^ 2**k and
    combines what comes back. All three move the same bytes.
    """
    dtype = x.dtype
    if x.size == 0:
        return _empty(x, x.shape[:dim] + (x.shape[dim] // size,) + x.shape[dim + 1:])
    chunk = x.shape[dim] // size
    if exchange == "halving":
        # (size, ..., chunk, ...): the chunks stacked in participant order
        work = jnp.moveaxis(x.reshape(x.shape[:dim] + (size, chunk) + x.shape[dim + 1:]), dim, 0)
        work = work.astype(jnp.float32) if dtype in _LOW_PRECISION and op not in ("max", "min") else _wire(work)
        position = lax.axis_index(axis)
        step = size // 2
        while step:
            upper = (position & step) != 0  # chunk `position` is in the upper half of what is left
            mine = lax.dynamic_slice_in_dim(work, jnp.where(upper, step, 0), step, 0)
            theirs = lax.dynamic_slice_in_dim(work, jnp.where(upper, 0, step), step, 0)
            work = _COMBINE[op](mine, _move(lax.ppermute, theirs, axis, perm=_partners(size, step)))
            step //= 2
        out = work[0] / size if op == "mean" else work[0]
        out = out.astype(dtype)
    elif op in ("sum", "mean") and dtype not in _LOW_PRECISION and exchange == "native":
        out = _move(lax.psum_scatter, x, axis, scatter_dimension=dim, tiled=True)
        if op == "mean":
            out = (out / size).astype(dtype)
    else:
        # Exchange chunks (all_to_all), then reduce the `size` received chunks locally.
        parts = jnp.moveaxis(x.reshape(x.shape[:dim] + (size, chunk) + x.shape[dim + 1:]), dim, 0)
        received = _move(lax.all_to_all, _wire(parts), axis, 0, 0).astype(dtype)
        out = _local_reduce(received, op, size)
    if scale != 1.0:
        out = (out * jnp.asarray(scale, dtype)).astype(dtype)
    return out


def _local_reduce(stacked: jax.Array, op: str, size: int) -> jax.Array:
    dtype = stacked.dtype
    if op in ("sum", "mean"):
        total = jnp.sum(stacked.astype(jnp.float32) if dtype in _LOW_PRECISION else stacked, axis=0)
        return (total / size if op == "mean" else total).astype(dtype)
    if op == "prod":
        return jnp.prod(stacked, axis=0).astype(dtype)
    return (jnp.max if op == "max" else jnp.min)(stacked, axis=0)


def all_to_all(x: jax.Array, split_dim: int, concat_dim: int, axis: str) -> jax.Array:
    """Splits `split_dim` into one chunk per participant, exchanges, concatenates on `concat_dim`."""
    if x.size == 0:
        size = lax.psum(1, axis)
        shape = list(x.shape)
        shape[split_dim] //= size
        shape[concat_dim] *= size
        return _empty(x, tuple(shape))
    return _move(lax.all_to_all, _wire(x), axis, split_dim, concat_dim, tiled=True).astype(x.dtype)


_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def broadcast(x: jax.Array, src: int, axis: str) -> jax.Array:
    """Every participant gets participant `src`'s value, bit for bit.

    Implemented as a sum in which only `src` contributes non-zero integers (the value's bits), so
    it moves one value's worth of data and keeps -0.0 and NaN payloads intact.
    """
    if x.size == 0:
        return x
    bits = _BITS[x.dtype.itemsize]
    raw = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else lax.bitcast_convert_type(x, bits)
    wide = raw.astype(jnp.int32) if raw.dtype.itemsize < 4 else raw
    mine = jnp.where(lax.axis_index(axis) == src, wide, jnp.zeros_like(wide))
    summed = _move(lax.psum, mine, axis).astype(raw.dtype)
    if x.dtype == jnp.bool_:
        return summed.astype(jnp.bool_)
    return lax.bitcast_convert_type(summed, x.dtype)


def permute(x: jax.Array, pairs: Sequence[tuple[int, int]], axis: str) -> jax.Array:
    """Sends each source's value to its destination; participants that receive nothing get zeros."""
    if x.size == 0:
        return x
    return _move(lax.ppermute, _wire(x), axis, perm=list(pairs)).astype(x.dtype)
