"""The public collectives. Each works eagerly across processes, or in-graph over a mesh axis.

Eager: call from ordinary code on every process; participants are processes (rank = process
index); `x` is a torch tensor, numpy array, jax array, Python scalar, or a list / tuple / dict of
them, and the result has the same structure, kinds, dtypes. With `groups` (torch_xla's replica
groups, e.g. [[0, 1], [2, 3]]) each process gets its own group's result.

In-graph: pass `axis="data"` inside `tpudist.compile` / `jax.jit(shard_map(...))` and the
collective runs over that mesh axis (`groups` does not apply there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tpudist._profile as _profile
from tpudist.collectives import _call, _convert, _lax
from tpudist.collectives._engine import SLOT, engine

_FLOATS = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _check_op(op: str, dtypes: Sequence[Any], scale: float) -> None:
    if op not in _lax.REDUCE_OPS:
        raise ValueError(f"op={op!r} is not a reduction tpudist knows; use one of {', '.join(_lax.REDUCE_OPS)}")
    for dtype in dtypes:
        if dtype == jnp.bool_ and op not in ("max", "min"):
            raise TypeError(f"op={op!r} is not defined for bool values; use op='max' (any) or op='min' (all)")
        if dtype not in _FLOATS and op == "mean":
            raise TypeError(f"op='mean' needs floating-point values, got {dtype}; use op='sum' and divide")
        if dtype not in _FLOATS and scale != 1.0:
            raise TypeError(f"scale={scale} needs floating-point values, got {dtype}")


# XLA's CPU collectives run gloo's ring algorithms, whose 2 * (P - 1) (all-reduce) or P - 1
# (all-gather) dependent message steps dominate below a few MiB; recursive doubling over
# collective-permutes takes log2(P) steps and, for P = 2, moves the same bytes. Measured with
# scripts/bench_collectives.py (docs/collectives.md): an eager collective uses it on CPU for a
# power-of-two group when the value (per process) is at most DOUBLING_MAX_BYTES[(kind, P)], P = 2
# or more; larger values (where the ring's fewer bytes per process win), other group sizes and
# other platforms (TPU and GPU interconnects) keep XLA's own collectives. An all-reduce of fewer
# elements than the group keeps the ring too, which is as quick there. For 2 processes past 4 MiB
# the ring won again in the latest runs (16 MiB: 26-31 ms against 46-66 ms).
DOUBLING_MAX_BYTES = {("all_reduce", 2): 4 << 20, ("all_reduce", "more"): 1 << 20,
                      ("all_gather", 2): 1 << 20, ("all_gather", "more"): 128 << 10}
# Past the doubling limit, an all-gather over more than 2 processes on CPU exchanges its blocks with
# one all-to-all (every process sends to every other at once) instead of gloo's ring of P - 1
# dependent steps, up to this many bytes per process (its input is P copies of the block). 4
# processes, 1 MiB gathered, alternating with the ring four times: 0.89-0.96x gloo against
# 1.24-1.37x; at 1 and 4 MiB per process the ring was as quick or quicker (0.86-0.88x against
# 0.97x; 0.73-1.02x against 1.18-1.20x).
ALL_TO_ALL_GATHER_MAX_BYTES = 256 << 10


def _exchange(kind: str, value: jax.Array, size: int) -> str:
    """How an eager collective of `value` over groups of `size` exchanges: "doubling" or "native"
    (all_reduce), "doubling", "all_to_all" or "native" (all_gather); "halving" or "all_to_all"
    (reduce_scatter)."""
    if kind == "reduce_scatter":
        # Recursive halving for pairs on CPU: 0.55-0.68x gloo from 4 MiB against all_to_all's
        # 0.73-0.88x (scripts/bench_collectives.py); for 4 processes it measured mixed (faster at
        # 16 MiB, slower at 64 KiB), so larger groups keep the all-to-all plus a local reduction.
        return "halving" if size == 2 and engine().device.platform == "cpu" else "all_to_all"
    if size < 2 or size & (size - 1) or engine().device.platform != "cpu":
        return "native"
    if kind == "all_reduce" and value.size < size:
        return "native"
    nbytes = value.size * value.dtype.itemsize
    if nbytes <= DOUBLING_MAX_BYTES[(kind, 2 if size == 2 else "more")]:
        return "doubling"
    if kind == "all_gather" and size > 2 and nbytes <= ALL_TO_ALL_GATHER_MAX_BYTES:
        return "all_to_all"
    return "native"


def _dim(dim: int, ndim: int, what: str) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"{what}={dim} is out of range for a value with {ndim} dimensions")
    return dim % max(ndim, 1)


def _divisible(leaf: _convert.Leaf, dim: int, size: int, what: str) -> None:
    if leaf.shape[dim] % size:
        raise ValueError(f"{what}: dimension {dim} of shape {leaf.shape} has size {leaf.shape[dim]}, "
                         f"which does not split into {size} equal chunks (one per process of the group); "
                         f"pad it to a multiple of {size}")


def _eager(name: str, params: dict[str, Any], x: Any, groups: Any,
           body: Callable[[list[jax.Array], int], list[jax.Array]],
           check: Callable[[list[_convert.Leaf], int], None] | None = None,
           detail: tuple[tuple[str, Any], ...] = (), traced: bool = True) -> Any:
    if traced and _profile.active:
        with _span(name, params, x, groups):
            return _call.run(name, params, x, groups, body, check, detail)
    return _call.run(name, params, x, groups, body, check, detail)


def _span(name: str, params: dict[str, Any], x: Any, groups: Any) -> Any:
    """The profile span of one eager call, named by its signature as peers compare it:
    `tpudist.all_reduce[float32(4,5) sum groups=[[0,1],[2,3]]]`. Built only while profiling; a
    single value's name is kept per repeat key (formatting it costs more than the span)."""
    key = None
    fp = _convert.fingerprint(x)
    if fp[0] != "scalar" or fp[1] in (bool, int, float):  # one leaf, fully described by fp
        key = _call.repeat_key(name, params, x, groups)
    label = _span_labels.get(key) if key is not None else None
    if label is None:
        label = _span_label(name, params, x, groups)
        if key is not None and len(_span_labels) < 4096:
            _span_labels[key] = label
    return _profile.span(label[0], bytes=label[1])


_span_labels: dict[Any, tuple[str, int]] = {}


def _span_label(name: str, params: dict[str, Any], x: Any, groups: Any) -> tuple[str, int]:
    try:
        descs = [_convert.describe(leaf) for leaf in jax.tree_util.tree_leaves(x)]
    except TypeError:
        descs = []  # the call itself reports what it does not take
    parts = [" ".join(f"{d.dtype}({','.join(map(str, d.shape))})" for d in descs[:4])
             + (f" +{len(descs) - 4} more" if len(descs) > 4 else "")]
    for k, v in params.items():
        if k == "op":
            parts.append(v)
        elif not (k == "scale" and v == 1.0):
            parts.append(f"{k}={v}".replace(" ", ""))
    if groups is not None:
        parts.append(f"groups={groups}".replace(" ", ""))
    label = " ".join(p for p in parts if p)
    return f"tpudist.{name}[{label}]", sum(d.nbytes for d in descs)


def _per_block(fn: Callable[[jax.Array, int], jax.Array]) -> Callable[[list[jax.Array], int], list[jax.Array]]:
    """Lifts fn(value, size) -> value to the engine's (1, 1, *shape) blocks."""
    def body(blocks: list[jax.Array], size: int) -> list[jax.Array]:
        outs = []
        for b in blocks:
            out = fn(b[0, 0], size)
            outs.append(out.reshape((1, 1) + out.shape))
        return outs
    return body


def _in_graph(x: Any, groups: Any, fn: Callable[[Any], Any]) -> Any:
    if groups is not None:
        raise ValueError("pass either axis= (in-graph, inside a compiled step) or groups= (eager), not both")
    return jax.tree_util.tree_map(fn, x)


def all_reduce(x: Any, op: str = "sum", groups: Sequence[Sequence[int]] | None = None,
               scale: float = 1.0, *, axis: str | None = None) -> Any:
    """Reduces `x` over every process (or each replica group) with `op` and multiplies by `scale`.

    op is one of "sum", "mean", "max", "min", "prod". A list of values is reduced in one compiled
    collective per dtype. Example::

        g = tpudist.all_reduce(torch.ones(3), op="mean")     # tensor([1., 1., 1.]) on every rank
    """
    if axis is not None:
        _check_op(op, [jnp.dtype(v.dtype) for v in jax.tree_util.tree_leaves(x)], scale)
        return _in_graph(x, groups, lambda v: _lax.reduce(v, op, axis, _axis_size(axis), scale))

    def check(descs: list[_convert.Leaf], size: int) -> None:
        _check_op(op, [d.dtype for d in descs], scale)

    body = _per_block(lambda v, size: _lax.reduce(v, op, SLOT, size, scale, _exchange("all_reduce", v, size)))
    params = {"op": op, "scale": float(scale)}
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if len(leaves) < 2:
        return _eager("all_reduce", params, x, groups, body, check)
    if _profile.active:
        with _span("all_reduce", params, x, groups):
            return _coalesced_all_reduce(leaves, treedef, params, groups, body, check)
    return _coalesced_all_reduce(leaves, treedef, params, groups, body, check)


def _coalesced_all_reduce(leaves: list[Any], treedef: Any, params: dict[str, Any], groups: Any,
                          body: Callable[[list[jax.Array], int], list[jax.Array]],
                          check: Callable[[list[_convert.Leaf], int], None]) -> Any:
    # Coalesce on the host, as DDP's buckets do: one flat buffer and one collective per dtype. The
    # executable then depends only on each buffer's length, so it is compiled once and reused.
    descs = [_convert.describe(leaf) for leaf in leaves]
    check(descs, 1)
    by_dtype: dict[Any, list[int]] = {}
    for i, d in enumerate(descs):
        by_dtype.setdefault(d.dtype, []).append(i)
    packed = [np.concatenate([_convert.flat_numpy(leaves[i], descs[i]) for i in idx]) for idx in by_dtype.values()]
    detail = (("number of values", len(leaves)), ("structure", str(treedef)), ("value shapes", [list(d.shape) for d in descs]),
              ("value dtypes", [str(d.dtype) for d in descs]))
    reduced = _eager("all_reduce", params, packed, groups, body, check, detail, traced=False)
    results: list[Any] = [None] * len(leaves)
    for idx, flat in zip(by_dtype.values(), reduced):
        offset = 0
        for i in idx:
            n = int(np.prod(descs[i].shape, dtype=np.int64))
            results[i] = _convert.from_flat(flat[offset:offset + n], descs[i])
            offset += n
    return jax.tree_util.tree_unflatten(treedef, results)


def _axis_size(axis: str) -> int:
    return jax.lax.psum(1, axis)


def all_gather(x: Any, dim: int = 0, groups: Sequence[Sequence[int]] | None = None, *,
               axis: str | None = None) -> Any:
    """Concatenates every process's `x` along tensor dimension `dim`, in rank (group) order.

    A 0-d value gathers into shape (processes,). Example: shape (2, 3) on 4 processes, dim=0
    -> (8, 3).
    """
    if axis is not None:
        return _in_graph(x, groups, lambda v: _lax.gather(v, _dim(dim, v.ndim, "dim"), axis))

    def check(descs: list[_convert.Leaf], size: int) -> None:
        for d in descs:
            _dim(dim, len(d.shape), "dim")

    body = _per_block(lambda v, size: _lax.gather(v, _dim(dim, v.ndim, "dim"), SLOT,
                                                  _exchange("all_gather", v, size)))
    return _eager("all_gather", {"dim": dim}, x, groups, body, check)


def reduce_scatter(x: Any, op: str = "sum", dim: int = 0, groups: Sequence[Sequence[int]] | None = None,
                   scale: float = 1.0, *, axis: str | None = None) -> Any:
    """Reduces `x` over the processes with `op`; process i keeps chunk i of dimension `dim`.

    `x.shape[dim]` must be a multiple of the group size. Example: shape (8, 3) on 4 processes
    -> (2, 3) on each.
    """
    if axis is not None:
        _check_op(op, [jnp.dtype(v.dtype) for v in jax.tree_util.tree_leaves(x)], scale)
        return _in_graph(x, groups, lambda v: _lax.reduce_scatter(
            v, op, _dim(dim, v.ndim, "dim"), axis, _axis_size(axis), scale))

    def check(descs: list[_convert.Leaf], size: int) -> None:
        _check_op(op, [d.dtype for d in descs], scale)
        for d in descs:
            if not d.shape:
                raise ValueError("reduce_scatter needs values with at least one dimension, got a scalar")
            _divisible(d, _dim(dim, len(d.shape), "dim"), size, "reduce_scatter")

    # Eagerly, never gloo's reduce-scatter: it ignores the collective timeout (jax#40831) and has
    # returned wrong values at 4 MiB chunks (jax#40830).
    body = _per_block(lambda v, size: _lax.reduce_scatter(v, op, _dim(dim, v.ndim, "dim"), SLOT, size, scale,
                                                          exchange=_exchange("reduce_scatter", v, size)))
    return _eager("reduce_scatter", {"op": op, "dim": dim, "scale": float(scale)}, x, groups,
                  body, check)


def all_to_all(x: Any, split_dim: int = 0, concat_dim: int = 0, groups: Sequence[Sequence[int]] | None = None,
               *, axis: str | None = None) -> Any:
    """Splits `split_dim` into one chunk per process, sends chunk j to process j, and concatenates
    what arrives along `concat_dim` in rank order."""
    if axis is not None:
        return _in_graph(x, groups, lambda v: _lax.all_to_all(
            v, _dim(split_dim, v.ndim, "split_dim"), _dim(concat_dim, v.ndim, "concat_dim"), axis))

    def check(descs: list[_convert.Leaf], size: int) -> None:
        for d in descs:
            if not d.shape:
                raise ValueError("all_to_all needs values with at least one dimension, got a scalar")
            _dim(concat_dim, len(d.shape), "concat_dim")
            _divisible(d, _dim(split_dim, len(d.shape), "split_dim"), size, "all_to_all")

    body = _per_block(lambda v, size: _lax.all_to_all(
        v, _dim(split_dim, v.ndim, "split_dim"), _dim(concat_dim, v.ndim, "concat_dim"), SLOT))
    return _eager("all_to_all", {"split_dim": split_dim, "concat_dim": concat_dim}, x, groups,
                  body, check)


def broadcast(x: Any, src: int = 0, groups: Sequence[Sequence[int]] | None = None, *,
              axis: str | None = None) -> Any:
    """Every process gets process `src`'s value, bit for bit.

    With groups, `src` is a position inside each group (group [2, 3] with src=0 takes rank 2's
    value). Every process must pass a value of the same shape and dtype.
    """
    if axis is not None:
        return _in_graph(x, groups, lambda v: _lax.broadcast(v, src, axis))

    def check(descs: list[_convert.Leaf], size: int) -> None:
        if not isinstance(src, int) or not 0 <= src < size:
            raise ValueError(f"src={src!r} must be a process index in [0, {size})"
                             + (" (a position inside each group)" if groups is not None else ""))

    body = _per_block(lambda v, size: _lax.broadcast(v, src, SLOT))
    return _eager("broadcast", {"src": src}, x, groups, body, check)


def _check_pairs(pairs: Any, n: int) -> tuple[tuple[int, int], ...]:
    try:
        norm = tuple((int(s), int(d)) for s, d in pairs)
    except (TypeError, ValueError):
        raise TypeError(f"pairs={pairs!r} must be a list of [source, destination] process indices") from None
    for s, d in norm:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"pair [{s}, {d}] names a process outside 0..{n - 1}")
    for what, values in (("source", [s for s, _ in norm]), ("destination", [d for _, d in norm])):
        dup = sorted({v for v in values if values.count(v) > 1})
        if dup:
            raise ValueError(f"pairs={pairs!r}: processes {dup} appear more than once as a {what}")
    return norm


def collective_permute(x: Any, pairs: Sequence[Sequence[int]], *, axis: str | None = None) -> Any:
    """Sends each source process's `x` to its destination; a process that receives nothing gets
    zeros. Example: pairs=[[0, 1], [1, 0]] swaps ranks 0 and 1."""
    if axis is not None:
        norm = _check_pairs(pairs, _axis_size(axis))
        return _in_graph(x, None, lambda v: _lax.permute(v, norm, axis))
    norm = _check_pairs(pairs, engine().n)
    body = _per_block(lambda v, size: _lax.permute(v, norm, SLOT))
    return _eager("collective_permute", {"pairs": norm}, x, None, body)


def barrier(timeout: float | None = None) -> None:
    """Returns once every process of the job has called barrier(); CollectiveTimeout names the
    ranks that did not come within `timeout` seconds (default TPUDIST_COLLECTIVE_TIMEOUT)."""
    if _profile.active:
        with _profile.span("tpudist.barrier"):
            return engine().barrier(timeout)
    engine().barrier(timeout)
