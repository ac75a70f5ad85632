"""Peers' agreement inside every eager collective's executable (see `_engine`).

Each process brings a header (rank, call number, a fingerprint of the call's signature) that the
executable all-gathers first, with a fixed payload beside it: values that fit there ride along and
each process computes its result from everyone's values; larger values move after the exchange,
each of their exchanges only where every header agrees. `_peers.Peers.mismatch` turns a
disagreement into the error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist._jaxcompat import varying_axes
from tpudist.collectives import _lax

if TYPE_CHECKING:
    from tpudist.collectives._engine import Op

SLOT = "s"  # mesh axis inside a replica group
GROUP = "g"  # mesh axis across replica groups


# The header each process brings to every eager collective: rank, sequence number, and the two
# 32-bit halves of the signature's fingerprint.
HEADER = 4
HEADER_BYTES = 4 * HEADER
_WIRE_DTYPES = frozenset(map(np.dtype, (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                        np.int64, np.uint64, np.float16, jnp.bfloat16, np.float32, np.float64)))


def payload_bytes(n: int) -> int:
    """The bytes of values that travel beside the header in every executable's first exchange, for a
    job of `n` processes: the same in every executable of the job, so that processes that called
    different collectives still exchange equal messages there (gloo aborts on unequal ones)."""
    return max(64, 8192 // n)


def _rides_with_header(blocks: list[Any], n: int) -> bool:
    """Whether the values fit beside the header: then the header exchange is the collective."""
    dtypes = [np.dtype(b.dtype) for b in blocks]
    return (all(d in _WIRE_DTYPES for d in dtypes)
            and sum(math.prod(b.shape[2:]) * d.itemsize for b, d in zip(blocks, dtypes)) <= payload_bytes(n))


def agreed(op: Op, lead: tuple[int, int], platform: str, blocks: list[Any]) -> Callable[..., list[jax.Array]]:
    """The executable's body. Its first step all-gathers every process's header with a payload of
    `payload_bytes` beside it. Values that fit in the payload ride there, and each process computes
    its result from everyone's values (the collective's own body, vmapped over its group), kept only
    where every header agrees; larger values run the collective after the exchange, each of its
    exchanges of data under a `lax.cond` that skips it where the headers disagree (`_lax.guarded`;
    the results computed there are never returned: the engine raises). Either way every process sees the same table of
    headers and the collective's data never moves between processes that disagree."""
    n = lead[0] * lead[1]
    width = payload_bytes(n)
    exchange = "doubling" if platform == "cpu" and n & (n - 1) == 0 else "native"
    # vmap's ppermute takes only full permutations, and collective_permute's pairs may be partial
    riding = op.name != "collective_permute" and _rides_with_header(blocks, n)

    def body(header: jax.Array, *xs: jax.Array) -> list[jax.Array]:
        payload = [_to_bytes(x[0, 0]) for x in xs] if riding else []
        used = sum(p.size for p in payload)
        row = jnp.concatenate([_to_bytes(header[0, 0]), *payload, jnp.zeros(width - used, jnp.uint8)])
        rows = _lax.gather(row, 0, (GROUP, SLOT), exchange).reshape(n, HEADER_BYTES + width)
        table = lax.bitcast_convert_type(rows[:, :HEADER_BYTES].reshape(n, HEADER, 4), jnp.int32)
        agree = jnp.all(table[:, 1:] == table[0, 1:])
        if riding:
            outs = _from_everyone(op, lead, rows[:, HEADER_BYTES:], xs, agree)
        else:
            with _lax.guarded(agree):  # each exchange of data runs only where every header agrees
                outs = [_varying(o) for o in op.body(list(xs), lead[1])]
        return [_varying(table.reshape((1, 1, n * HEADER)))] + outs
    return body


def _from_everyone(op: Op, lead: tuple[int, int], data: jax.Array, xs: tuple[jax.Array, ...],
                   agree: jax.Array) -> list[jax.Array]:
    """This process's results of `op`, computed from every process's values (`data`: one row of
    payload bytes per process, in mesh order): its group's rows decoded and `op.body` vmapped over
    the slot axis, so each collective's own arithmetic (and order of combining) applies. Every
    process of a group computes the same thing, so all get bit-identical results."""
    groups, slots = lead
    mine = lax.dynamic_index_in_dim(data.reshape(groups, slots, -1), lax.axis_index(GROUP), keepdims=False)
    values, offset = [], 0
    for x in xs:
        nbytes = math.prod(x.shape[2:]) * x.dtype.itemsize
        values.append(_from_bytes(mine[:, offset:offset + nbytes], x.dtype, x.shape[2:]))
        offset += nbytes
    outs = jax.vmap(lambda *vs: op.body([v[None, None] for v in vs], slots), axis_name=SLOT)(*values)
    here = lax.axis_index(SLOT)
    return [_varying(jnp.where(agree, o[here], jnp.zeros((), o.dtype))) for o in outs]


def _to_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(raw: jax.Array, dtype: Any, shape: tuple[int, ...]) -> jax.Array:
    """`raw` (rows, nbytes) uint8 -> (rows, *shape) of `dtype`."""
    rows = raw.shape[0]
    if dtype == jnp.bool_:
        return raw.reshape((rows,) + shape).astype(jnp.bool_)
    size = np.dtype(dtype).itemsize
    if size == 1:
        return lax.bitcast_convert_type(raw, dtype).reshape((rows,) + shape)
    return lax.bitcast_convert_type(raw.reshape((rows, -1, size)), dtype).reshape((rows,) + shape)


def _varying(x: jax.Array) -> jax.Array:
    """`x` marked as varying over both mesh axes, as the executable's out_specs say."""
    missing = tuple(a for a in (GROUP, SLOT) if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class Check:
    """What a call's header and, on a disagreement, its error are made of."""

    op: Op
    groups: tuple[tuple[int, ...], ...]
    blocks: list[Any]
    fingerprint: tuple[int, int]


def fingerprint(key: Any, detail: tuple[tuple[str, Any], ...]) -> tuple[int, int]:
    """Two int32 words that differ, but for a 2**-64 chance, between calls peers must not mix.
    The key's and detail's reprs are the same in every process of a job (one Python, one numpy)."""
    digest = hashlib.blake2b(repr((key, detail)).encode(), digest_size=8).digest()
    hi, lo = np.frombuffer(digest, np.int32)
    return int(hi), int(lo)
