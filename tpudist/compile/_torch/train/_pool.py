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

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

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


def stacked_cut(packing: Packing, pool: list[jax.Array], layout: "Layout",
                groups: list[list[int]]) -> EntryArrays:
    """Inside the step: the pool cut into per-entry arrays (`unflatten_state`), except that each of
    `groups` (the layout positions of one parameter of a run of layers, layer by layer) comes as one
    stack at its first position, its parameter and each optimizer-state array with a leading layer
    dim, and None (no state) at the others. A run's copies lie at equal steps in the pool (the
    layers' entries are laid out alike), so a stack is one strided view of a pool buffer: XLA
    cuts nothing per layer (it compiles a kernel per piece otherwise: 216 of a 12-layer GPT-2's 421)."""
    import jax.numpy as jnp
    from jax import lax
    where = _places(packing, len(pool))
    index = _flat_index(layout)
    stacked = {i for group in groups for i in group}
    wanted = [m for (kind, i, _), m in index.items() if i not in stacked]

    def piece(m: int) -> jax.Array:
        buffer, offset = where[m]
        if offset is None:
            return pool[buffer]
        return lax.slice(pool[buffer], (offset,), (offset + math.prod(packing.shapes[m]),)).reshape(packing.shapes[m])

    def stack(members: list[int]) -> jax.Array:
        shape, count = packing.shapes[members[0]], len(members)
        size = math.prod(shape)
        regular = _regular(members, where)
        if regular is None or regular[2] < size:
            return jnp.stack([piece(m) for m in members])
        buffer, start, step = regular
        flat = pool[buffer]
        end = start + count * step
        view = lax.slice(flat, (start,), (min(end, flat.shape[0]),))
        if end > flat.shape[0]:  # the last layer's step runs past the buffer: pad it, the pad is never read
            view = jnp.pad(view, (0, end - flat.shape[0]))
        view = view.reshape(count, step)
        if step > size:
            view = lax.slice(view, (0, 0), (count, size))
        return view.reshape((count,) + shape)

    flat = {m: piece(m) for m in wanted}
    params = [flat.get(index["p", i, 0]) for i in range(len(layout))]
    states = [tuple(flat.get(index["s", i, k]) for k in range(len(e.config.state)))
              for i, e in enumerate(layout.entries)]
    for group in groups:
        params[group[0]] = stack([index["p", i, 0] for i in group])
        slots = len(layout.entries[group[0]].config.state)
        states[group[0]] = tuple(stack([index["s", i, k] for i in group]) for k in range(slots))
        for i in group[1:]:
            states[i] = ()
    return EntryArrays(params, states)


def stacked_pack(packing: Packing, layout: "Layout", params: list[jax.Array], states: list[tuple[jax.Array, ...]],
                 groups: list[list[int]]) -> list[jax.Array]:
    """Inside the step: `stacked_cut`'s inverse, the pool (`Packing.pack`'s buffers) from per-entry
    arrays with `groups` as stacks. Where the stacks of a pool buffer's stretch make up every layer's
    place in it (the layers' entries lie one after another, each layer alike), that stretch is the
    stacks side by side, one (layers, width) block: nothing is cut per layer."""
    import jax.numpy as jnp
    where = _places(packing, len(packing.groups) + len(packing.alone))
    index = _flat_index(layout)
    arrays: list[Any] = flatten_state(params, [s if len(s) == len(e.config.state) else (None,) * len(e.config.state)
                                               for s, e in zip(states, layout.entries)])
    stacks: dict[int, tuple[jax.Array, int]] = {}  # a stacked member -> (its stack, its row)
    runs: list[tuple[list[int], jax.Array]] = []    # a stack's members, layer by layer, and the stack
    for group in groups:
        tags = [("p", 0, params[group[0]])] + [("s", k, a) for k, a in enumerate(states[group[0]])]
        for kind, k, stack in tags:
            members = [index[kind, i, k] for i in group]
            stack = stack.astype(packing.dtypes[members[0]])
            runs.append((members, stack))
            stacks.update({m: (stack, row) for row, m in enumerate(members)})
    blocks = _blocks(packing, where, runs)

    def piece(m: int) -> jax.Array:
        if m in stacks:
            stack, row = stacks[m]
            return stack[row]
        return arrays[m].astype(packing.dtypes[m])

    out = []
    for buffer, places in enumerate(packing.places):
        operands, covered = [], -1
        for m, _, _, offset in places:
            if offset < covered:
                continue
            if m in blocks:
                block, covered = blocks[m]
                operands.append(block)
            else:
                operands.append(piece(m).reshape(-1))
        out.append(jnp.concatenate(operands))
    return out + [piece(m) for m in packing.alone]


def _blocks(packing: Packing, where: dict, runs: list[tuple[list[int], jax.Array]]) -> dict[int, tuple[jax.Array, int]]:
    """`stacked_pack`'s blocks: the first member of a block -> (the block, flat, and the offset it ends at)."""
    import jax.numpy as jnp
    regular: dict[tuple[int, int, int], list[tuple[int, int, jax.Array]]] = {}  # (buffer, step, layers) -> runs
    for members, stack in runs:
        found = _regular(members, where)
        if found is not None:
            buffer, start, step = found
            regular.setdefault((buffer, step, len(members)), []).append((start, members[0], stack))
    blocks = {}
    for (_, step, layers), found in regular.items():
        found.sort(key=lambda run: run[0])
        at = 0
        while at < len(found):  # a block: runs whose first layer's places fill [start, start + step) exactly
            start, end, width = found[at][0], at, 0
            while end < len(found) and found[end][0] == start + width and width < step:
                width += math.prod(found[end][2].shape[1:])
                end += 1
            if width == step:
                block = jnp.concatenate([stack.reshape(layers, -1) for _, _, stack in found[at:end]], axis=1)
                blocks[found[at][1]] = (block.reshape(-1), start + layers * step)
                at = end
            else:
                at += 1
    return blocks


def _regular(members: list[int], where: dict) -> tuple[int, int, int] | None:
    """(buffer, first offset, step) where these packed arrays lie in one pool buffer at equal steps;
    None otherwise."""
    buffers = {where[m][0] for m in members}
    offsets = [where[m][1] for m in members]
    if len(buffers) != 1 or None in offsets or len(members) < 2:
        return None
    step = offsets[1] - offsets[0]
    if step <= 0 or offsets != [offsets[0] + k * step for k in range(len(members))]:
        return None
    return buffers.pop(), offsets[0], step


def _places(packing: Packing, count: int) -> dict[int, tuple[int, int | None]]:
    """Where each of the packed arrays lies among `count` crossed buffers: (buffer, offset in it), or
    (buffer, None) for one that crosses alone."""
    where: dict[int, tuple[int, int | None]] = {}
    for buffer, places in enumerate(packing.places):
        for i, _, _, offset in places:
            where[i] = (buffer, offset)
    for buffer, i in enumerate(packing.alone, start=len(packing.groups)):
        where[i] = (buffer, None)
    assert len(where) == len(packing.shapes) and count == len(packing.groups) + len(packing.alone)
    return where


def _flat_index(layout: "Layout") -> dict[tuple[str, int, int], int]:
    """("p", entry, 0) and ("s", entry, k) -> the position in `flatten_state`'s order."""
    tags = flatten_state([("p", i, 0) for i in range(len(layout))],
                         [tuple(("s", i, k) for k in range(len(e.config.state))) for i, e in enumerate(layout.entries)])
    return {tag: m for m, tag in enumerate(tags)}
