"""The one-device fused step's parameters and optimizer state as a pool of few buffers.

XLA:CPU's launch of an executable costs the calling thread ~15 us plus ~1-2.5 us per buffer
(measured: a jitted function over 1, 4, 9, 16, 32 donated arrays, 3.3-50 us), which was most of a
small model's step. So on one device the step takes and returns its parameters and optimizer
state as a pool: every array of up to `POOL_MAX_BYTES` packed into one flat buffer per dtype
(`_pack.Packing`), the larger ones as they are; the executable cuts the pool apart as it starts
and packs it again as it ends (`_signature._pooled`). The per-entry arrays are cut out of the pool on
the host only when something reads them (a door, a checkpoint), and packed again only when they
changed (an upload from torch, a restore).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax

from tpudist.compile._torch._pack import Packing

if TYPE_CHECKING:
    from tpudist.compile._torch.train._plan import Layout
    from tpudist.compile._torch.train._stages import Stacking

# a parameter or optimizer-state array this size or smaller joins the pool. Larger ones cost the
# device more to pack than their launch costs the host: the 32-256-4 MLP's step given its batch on
# the device, 32 KiB weights pooled (64 KiB limit) 65-70 us against 58-61 us kept apart (4 KiB)
POOL_MAX_BYTES = 4 << 10


class EntryArrays(NamedTuple):
    """The parameters and optimizer state, per layout entry: `params[i]` and the arrays of
    `states[i]` (one per name in its `ParamConfig.state`). As a step's arguments with the pool:
    `params` is the pool's buffers and `states` is empty."""

    params: list[jax.Array]
    states: list[tuple[jax.Array, ...]]


class StatePool:
    """Per layout entry, the parameter and its optimizer-state arrays, held as arrays or (when
    `pooled`) as the pool the last step returned, whichever is current."""

    def __init__(self, layout: "Layout", pooled: bool):
        self.layout, self.pooled = layout, pooled
        # per entry, current unless None (then the pool is); the pool: current unless None
        self._entries: EntryArrays | None = EntryArrays([], [])
        self._pool: list[jax.Array] | None = None
        self.packing: Packing | None = None  # the pool's layout (fixed by the arrays it was made of)
        self._pieces: Callable[..., list[list[jax.Array]]] | None = None  # packing.pieces, jitted
        # pipeline parallelism: runs of entries the step takes stacked (`_stages`), current unless None
        self.stacking: Stacking | None = None
        self._stacked: EntryArrays | None = None

    def stack(self, stacking: "Stacking") -> None:
        """From now on the step takes these runs of entries stacked (`_stages`); the same runs as before
        or ValueError (every signature of one step holds the state one way)."""
        if self.stacking is not None:
            if stacking.groups != self.stacking.groups:
                raise ValueError("pipeline parallelism: this batch's capture splits the model's layers into "
                                 "stages differently from the step's first; compile a step per model form")
            return
        self.entries()
        self.stacking, self._stacked = stacking, None

    def entries(self) -> EntryArrays:
        """(params, states), cut out of the pool first if a step returned it (one executable)."""
        if self._entries is None and self._stacked is not None:
            self._entries = EntryArrays(*self.stacking.unstack(*self._stacked))
        if self._entries is None:
            self._entries = unflatten_state(self.packing.split(self._pool, self._pieces), self.layout)
        return self._entries

    def set(self, params: list[jax.Array], states: list[tuple[jax.Array, ...]]) -> None:
        """Makes these per-entry arrays current (the pool is packed again when a step needs it)."""
        self._entries, self._pool = EntryArrays(list(params), [tuple(s) for s in states]), None
        self._stacked = None

    def step_arrays(self) -> EntryArrays:
        """What a step takes for the parameters and optimizer state: (params, states), or when
        pooled (the pool, []), packed here if the per-entry arrays changed since the last step."""
        if self.stacking is not None:
            if self._stacked is None:
                self._stacked = EntryArrays(*self.stacking.stack(*self.entries()))
            return self._stacked
        if not self.pooled:
            return self.entries()
        if self._pool is None:
            flat = flatten_state(*self._entries)
            packing = Packing.of(flat, POOL_MAX_BYTES)
            if self.packing is None or packing.key != self.packing.key:
                self.packing, self._pieces = packing, jax.jit(packing.pieces)
            self._pool = packing.pack(flat, _concat)
        return EntryArrays(self._pool, [])

    def held(self) -> tuple[list[jax.Array], Packing | None]:
        """What the next step will take, without packing anything: the pool's buffers and its
        packing, or (pool not current) the per-entry arrays in `flatten_state`'s order and None."""
        if self.pooled and self._pool is not None:
            return list(self._pool), self.packing
        if self.stacking is not None:
            return flatten_state(*self.step_arrays()), None
        return flatten_state(*self._entries), None

    def stepped(self, params: list[jax.Array], states: list[tuple[jax.Array, ...]]) -> None:
        """A step's new state, in the form `step_arrays` gave it."""
        if self.pooled:
            self._pool, self._entries = params, None
        elif self.stacking is not None:
            self._stacked, self._entries = EntryArrays(params, states), None
        else:
            self._entries = EntryArrays(params, states)


_concat = jax.jit(Packing.concat)  # the pool's group buffers from their members' arrays


def flatten_state(params: list[jax.Array], states: list[tuple[jax.Array, ...]]) -> list[jax.Array]:
    """The pool's order: every parameter, then every entry's first optimizer-state array, then every
    second one: the update of the pooled parameters together (`_optim.update_all`) then writes
    each of these runs of the pool whole, not piece by piece."""
    slots = max((len(s) for s in states), default=0)
    return list(params) + [s[k] for k in range(slots) for s in states if k < len(s)]


def unflatten_state(flat: list[jax.Array], layout: "Layout") -> EntryArrays:
    """`flatten_state`'s inverse for `layout`'s entries."""
    params, rest = list(flat[:len(layout)]), iter(flat[len(layout):])
    counts = [len(e.config.state) for e in layout.entries]
    states: list[list[jax.Array]] = [[] for _ in counts]
    for k in range(max(counts, default=0)):
        for entry, count in zip(states, counts):
            if k < count:
                entry.append(next(rest))
    return EntryArrays(params, [tuple(s) for s in states])
