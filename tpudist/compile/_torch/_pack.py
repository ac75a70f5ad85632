"""Packing: many small arrays cross from XLA to torch as one buffer.

Each array that crosses to torch pays a fixed cost (on CPU 10-20 us: DLPack export, waiting for
readiness, torch's import), which is a compiled module's whole budget for a small model's
gradients. So the executable concatenates the small arrays of each dtype into one flat buffer
(XLA writes them there directly; the concatenation fuses with their producers), one crossing
brings it over, and torch takes views of it. Large arrays cross alone: their copy into a buffer
would cost more than their crossing.

The layout is a pure function of the arrays' shapes and dtypes, so the traced `pack` inside the
executable and the host's `unpack` compute the same one without sharing state.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch

from tpudist._buffers import torch_view
from tpudist.compile._torch._convert import to_torch

PACK_MAX_BYTES = 64 << 10  # an array this size or smaller is packed; ~ the bytes one crossing costs to copy


class Packing:
    """The crossing layout of a list of arrays with these `(shape, dtype)`s: `pack` (traced) gives
    the arrays to return from the executable, `unpack` (host) the torch tensors, in the original
    order. Example:

        packing = Packing.of(grads)                    # same shapes inside and outside jit
        crossed = packing.pack(grads)                  # inside jit: [flat float32 buffer]
        tensors = packing.unpack(crossed, [torch.float32] * len(grads))
    """

    def __init__(self, avals: list[tuple[tuple[int, ...], np.dtype]], max_bytes: int = PACK_MAX_BYTES):
        self.shapes = [tuple(shape) for shape, _ in avals]
        self.dtypes = [np.dtype(dtype) for _, dtype in avals]
        self.key = (tuple(zip(self.shapes, self.dtypes)), max_bytes)  # equal keys: equal layouts
        by_dtype: dict[np.dtype, list[int]] = {}
        alone: list[int] = []
        for i, (shape, dtype) in enumerate(avals):
            if math.prod(shape) * np.dtype(dtype).itemsize <= max_bytes:
                by_dtype.setdefault(np.dtype(dtype), []).append(i)
            else:
                alone.append(i)
        # a group of one gains nothing from a buffer of its own
        self.groups = [members for members in by_dtype.values() if len(members) > 1]
        alone += [members[0] for members in by_dtype.values() if len(members) == 1]
        self.alone = sorted(alone)
        # where each member lies in its group's buffer, as torch.as_strided takes it: (index, shape,
        # contiguous strides, offset); one view each, without split's list and per-piece reshapes
        self.places = [[(i, self.shapes[i], _strides(self.shapes[i]), offset)
                        for i, offset in zip(members, _offsets([math.prod(self.shapes[i]) for i in members]))]
                       for members in self.groups]
        self.trivial = not self.groups  # nothing to pack: the arrays cross as they are

    @classmethod
    def of(cls, arrays: list[Any], max_bytes: int = PACK_MAX_BYTES) -> Packing:
        return cls([(tuple(a.shape), np.dtype(a.dtype)) for a in arrays], max_bytes)

    def pack(self, arrays: list[Any], concat: Any = None) -> list[Any]:
        """Inside the executable: one flat buffer per group, then the arrays that cross alone.
        On the host, `concat` is `concat` jitted (the large arrays then pass by untouched)."""
        if self.trivial:
            return list(arrays)
        groups = [[arrays[i] for i in members] for members in self.groups]
        return list((concat or self.concat)(groups)) + [arrays[i] for i in self.alone]

    def split(self, crossed: list[Any], pieces: Any = None) -> list[Any]:
        """Inside an executable: `pack`'s inverse, the arrays in the original order. On the host,
        `pieces` is `self.pieces` jitted."""
        if self.trivial:
            return list(crossed)
        out: list[Any] = [None] * len(self.shapes)
        for members, cut in zip(self.groups, (pieces or self.pieces)(crossed[:len(self.groups)])):
            for i, piece in zip(members, cut):
                out[i] = piece
        for i, array in zip(self.alone, crossed[len(self.groups):]):
            out[i] = array
        return out

    @staticmethod
    def concat(groups: list[list[Any]]) -> list[Any]:
        """Traced: each group's arrays as one flat buffer (what `pack` does to the groups)."""
        import jax.numpy as jnp
        return [jnp.concatenate([a.reshape(-1) for a in members]) for members in groups]

    def pieces(self, flats: list[Any]) -> list[list[Any]]:
        """Traced: each group buffer cut back into its members' arrays (what `split` does to them)."""
        from jax import lax  # (lax.slice: jnp's indexing costs ~0.5 ms of tracing a piece)
        return [[lax.slice(flat, (offset,), (offset + math.prod(shape),)).reshape(shape)
                 for _, shape, _, offset in places] for places, flat in zip(self.places, flats)]

    def unpack(self, crossed: list[Any], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """On the host: torch tensors (views of the crossed buffers, or `dtypes[i]` copies where
        the bridge computed in a narrower dtype) in the original order."""
        if self.trivial:
            return [to_torch(a, dtype) for a, dtype in zip(crossed, dtypes)]
        out: list[Any] = [None] * len(self.shapes)
        for places, flat in zip(self.places, crossed):
            view = torch_view(flat).as_strided
            for i, shape, strides, offset in places:
                piece = view(shape, strides, offset)
                out[i] = piece if piece.dtype == dtypes[i] else piece.to(dtypes[i])
        for i, array in zip(self.alone, crossed[len(self.groups):]):
            out[i] = to_torch(array, dtypes[i])
        return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides (in elements) for `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _offsets(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of these `sizes` starts."""
    return list(itertools.accumulate(sizes[:-1], initial=0))
