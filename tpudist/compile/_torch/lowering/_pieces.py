"""Slices that cut one tensor into disjoint parts, lowered as one `lax.split` (see `sibling_pieces`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jax import lax


@dataclass(frozen=True)
class Piece:
    """One of several disjoint slices of the same tensor along one dimension (see sibling_pieces)."""

    source: torch.fx.Node
    dim: int
    sizes: tuple[int, ...]  # the pieces the dimension is cut into
    index: int              # which piece this node is
    squeeze: bool           # a `select` (the dimension dropped) rather than a `slice`


def sibling_pieces(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, Piece]:
    """`select` / `slice` nodes that cut one tensor into disjoint parts along one dimension, as
    MultiheadAttention's `proj[0], proj[1], proj[2]` or `x[..., :n], x[..., n:]` do.

    Lowered one by one, each part's gradient is the whole tensor padded with zeros, and the
    backward adds the padded copies up (three full-size writes and reads for q, k, v). Cut by one
    `lax.split`, the gradient is one concatenation of the parts' gradients, which XLA fuses into
    its consumer, as it does for `jnp.split` in hand-written JAX. Ranges that overlap are left to
    their own lowering."""
    aten = torch.ops.aten
    groups: dict[tuple[torch.fx.Node, int], list[tuple[torch.fx.Node, int, int, bool]]] = {}
    for node in nodes:
        if node.op != "call_function" or node.target not in (aten.select.int, aten.slice.Tensor) or node.kwargs:
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        args = list(node.args[1:]) + [None] * 4
        d = args[0] if args[0] is not None else 0
        if not isinstance(d, int):
            continue
        d %= value.ndim
        size = value.shape[d]
        if not isinstance(size, int):
            continue
        if node.target is aten.select.int:
            if not isinstance(args[1], int) or not -size <= args[1] < size:
                continue
            lo = args[1] % size
            hi, squeeze = lo + 1, True
        else:
            start, end, step = args[1], args[2], args[3] if args[3] is not None else 1
            if step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
                continue
            lo, hi, _ = slice(start, end).indices(size)
            if hi <= lo or (lo, hi) == (0, size):
                continue
            squeeze = False
        groups.setdefault((source, d), []).append((node, lo, hi, squeeze))
    pieces: dict[torch.fx.Node, Piece] = {}
    for (source, d), members in groups.items():
        ranges = sorted({(lo, hi) for _, lo, hi, _ in members})
        if len(ranges) < 2 or any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            continue  # one part (nothing to share) or overlapping parts
        size = source.meta["val"].shape[d]
        cuts = sorted({0, size, *(lo for lo, _ in ranges), *(hi for _, hi in ranges)})
        sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))
        for node, lo, _, squeeze in members:
            pieces[node] = Piece(source, d, sizes, cuts.index(lo), squeeze)
    return pieces


def piece(piece: Piece, env: dict, splits: dict) -> Any:
    parts = splits.get((piece.source, piece.dim))
    if parts is None:
        parts = splits[(piece.source, piece.dim)] = lax.split(env[piece.source], piece.sizes, axis=piece.dim)
    part = parts[piece.index]
    return lax.squeeze(part, (piece.dim,)) if piece.squeeze else part
