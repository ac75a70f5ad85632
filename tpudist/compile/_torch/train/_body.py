"""The per-device body of the fused train step, run under `shard_map` over the "data" axis.

    body(params, fixed, updated, states, counts, hyper, batch, rng, signal)
        -> StepOutputs(params, updated, states, counts, loss, rng, signal)

Each device differentiates the loss of its slice of the batch (in `accumulate` micro-batches,
one after another, if asked), the gradients of replicated parameters are averaged over the axis
in one all-reduce (`ShardedEmbedding` rows are already summed by their lookup's backward), then
every trained parameter takes its optimizer's update (`_optim.update_all`). Parameters the graph does
not train pass through unchanged, as do their optimizer state and step count, as torch.optim
skips a parameter without a gradient. The random key is split once per step and folded with the
device's position, so each step and each device draws its own dropout masks. `signal` (one float
per device) comes back averaged over every device, in the same all-reduce as the gradients: a
flag any process raises (fit's "stop and save", on SIGTERM) reaches every process at the same step
without a collective of its own. `rng` and `signal` are None (no arrays at all) in steps that draw
no random numbers or take no flag.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpudist import contract
from tpudist.compile._torch.train import _optim
from tpudist.compile._torch._placement import AXIS
from tpudist.compile._torch.lowering._parallel import CONTEXT_AXIS, STAGE_AXIS, sequence_split
from tpudist.compile._torch.train._plan import Feed, Layout, Plan
from tpudist.compile._torch.train._stages import Stacking
from tpudist.compile._torch.lowering.ops.collective import over_axis
from tpudist.compile._torch.lowering._pipeline import Rows


class StepOutputs(NamedTuple):
    """What one step returns (a pytree; on the host each field is a global array, or None): the
    new state the next step takes, and this step's loss, key and agreed flag."""

    params: list[jax.Array]              # per layout entry its parameter, or the one-device pool (_pool)
    updated: list[jax.Array]             # buffers the graph writes back (BatchNorm's), in `Plan.updated` order
    states: list[tuple[jax.Array, ...]]  # per layout entry its optimizer-state arrays ([] with the pool)
    counts: jax.Array                    # every layout entry's step count (float32)
    loss: jax.Array                      # per device its loss (one float32 each)
    rng: jax.Array | None                # the random stream's next key data (None: the graph draws nothing)
    signal: jax.Array | None             # the flag, averaged over every device (None: the step took none)


def make_body(plan: Plan, layout: Layout, run: Callable[..., Any], *, devices: int, accumulate: int,
              random: bool, max_norm: float | None, collective: bool = True,
              together_bytes: int = 0, rows: dict[int, tuple[int, int]] | None = None) -> Callable[..., StepOutputs]:
    """The per-device step for one captured graph (`run`, from `_lower.lower`).

    `collective=False` (one device, nothing sharded: the caller then passes the batch and the
    signal replicated, so every value is the same on "all" devices) leaves the averaging out:
    XLA:CPU keeps an all-reduce even over one device, a copy of every gradient plus a fixed cost
    (~150 us a step on the transformer benchmark). Parameters of up to `together_bytes` take
    their optimizer update together (`_optim.update_all`: where the pool packs them anyway).

    `rows` (layout position -> (the position holding its stack, its row)): runs of layers' parameters
    the step takes stacked at their first position (None at the others), with their optimizer state
    the same way; a run's scan takes the stack whole (`_pool.stacked_cut`)."""
    vary = (lambda x: lax.pcast(x, AXIS, to="varying")) if collective else (lambda x: x)
    bucket = bucket_bytes()
    mean = (lambda xs: bucketed_mean(xs, AXIS, bucket)) if collective else (lambda xs: xs)
    rows = rows or {}
    trainable = [i for i in plan.trainable if rows.get(i, (i,))[0] == i]  # each stack once, at its first entry
    count_rows, layers = _count_rows(trainable, rows)
    entries = layout.entries
    sharded = [entries[i].sharded for i in trainable]
    configs = [entries[i].config for i in trainable]
    groups = [entries[i].group for i in trainable]
    stepped = np.zeros(len(layout), np.float32)
    stepped[plan.trainable] = 1.0  # whose step count advances
    gradient = _gradient(plan, run, trainable, rows)

    def accumulated(own, params, fixed, updated, batch, key):
        """Gradients summed over `accumulate` slices of the batch, run one after another (the
        updated BatchNorm statistics of one feed the next, as K eager forwards do), then averaged."""
        micro = [b.reshape((accumulate, b.shape[0] // accumulate) + b.shape[1:]) for b in batch]
        updated = [vary(u) for u in updated]  # replicated in, per device out
        zeros = [jnp.zeros_like(p) for p in own]  # of `own`: already per device
        return _accumulated(gradient, (own, params, fixed), (zeros, vary(jnp.float32(0)), updated), micro, key,
                            accumulate, random)

    def body(params, fixed, updated, states, counts, hyper, batch, rng, signal):
        if random:
            key, next_key = jax.random.split(jax.random.wrap_key_data(rng))
            rng = jax.random.key_data(next_key)
            if collective:  # each device its own draws; one device keeps the key replicated, as its outputs are
                key = jax.random.fold_in(key, lax.axis_index(AXIS))
        else:
            key = None
        # differentiate each device's own loss: marked as varying over the axis, a replicated
        # parameter's gradient is this device's alone (not implicitly summed by the transpose)
        own = [params[i] if s else vary(params[i]) for i, s in zip(trainable, sharded)]
        with over_axis(AXIS, devices):
            grad_fn = gradient if accumulate == 1 else accumulated
            (loss, new_updated), grads = grad_fn(own, params, fixed, updated, batch, key)
        replicated = [j for j, s in enumerate(sharded) if not s]
        flag = [] if signal is None else [signal.reshape(())]  # None: no process may raise one
        means = mean([grads[j] for j in replicated] + flag)
        if signal is not None:
            *means, signal = means
        for j, g in zip(replicated, means):
            grads[j] = g
        grads = [g / devices if s else g for g, s in zip(grads, sharded)]
        if max_norm is not None:
            grads = _clip(grads, sharded, max_norm)
        new_params, new_states = list(params), list(states)
        updates = _optim.update_all(configs, groups, [params[i] for i in trainable], grads,
                                    [states[i] for i in trainable], hyper, counts[count_rows], together_bytes, layers)
        for i, p, s in zip(trainable, *updates):
            new_params[i], new_states[i] = p, s
        if collective:
            floats = [j for j, b in enumerate(new_updated) if jnp.issubdtype(b.dtype, jnp.floating)]
            averaged = dict(zip(floats, mean([new_updated[j] for j in floats])))
            new_updated = [averaged[j] if j in averaged else lax.pmax(b, AXIS) for j, b in enumerate(new_updated)]
        return StepOutputs(new_params, new_updated, new_states, counts + stepped, loss.reshape(1), rng, signal)

    return body


# Gradients smaller than SMALL_BYTES are averaged together, in buffers of up to BUCKET_BYTES; larger
# ones alone. Measured on 2 processes over gloo (scripts/bench_torch.py dp): 26 arrays of 400 B
# 6.1 -> 0.4 ms in one buffer, but the bench MLP's 5 MiB of gradients 15 -> 69 ms a step as one
# buffer: gloo's all-reduce of one large buffer is slower than of its pieces.
SMALL_BYTES = 64 << 10
BUCKET_BYTES = 1 << 20


def bucket_bytes() -> int:
    """The gradient bucket size: `TPUDIST_GRAD_BUCKET_MB` (default 1; 0: one all-reduce per array)."""
    raw = os.environ.get(contract.GRAD_BUCKET_MB)
    if raw is None:
        return BUCKET_BYTES
    try:
        value = float(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{contract.GRAD_BUCKET_MB}={raw!r}: give a size in MiB (25), or 0 for one all-reduce per "
                         "gradient") from None
    return int(value * (1 << 20))


def bucketed_mean(xs: list[jax.Array], axis: str, bucket_bytes: int = BUCKET_BYTES) -> list[jax.Array]:
    """`lax.pmean(xs, axis)` as few all-reduces: the arrays under SMALL_BYTES flattened into one
    buffer per dtype and up to `bucket_bytes`, filled from the last array back (the order backward
    produces gradients, as DDP's buckets), averaged, and cut apart again; larger arrays alone.
    XLA:CPU runs one all-reduce per array otherwise, each with a fixed cost across processes."""
    if bucket_bytes == 0:
        return [lax.pmean(x, axis) for x in xs]
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], list[int]]] = {}  # dtype -> (members, bytes)
    for i in reversed(range(len(xs))):
        x = xs[i]
        nbytes = x.size * x.dtype.itemsize
        if nbytes >= SMALL_BYTES:
            buckets.append([i])
            continue
        members, size = open_bucket.get(x.dtype, ([], [0]))
        if members and size[0] + nbytes > bucket_bytes:
            buckets.append(members)
            members, size = [], [0]
        members.append(i)
        size[0] += nbytes
        open_bucket[x.dtype] = (members, size)
    buckets += [members for members, _ in open_bucket.values()]
    out: list[Any] = [None] * len(xs)
    for members in buckets:
        if len(members) == 1:
            out[members[0]] = lax.pmean(xs[members[0]], axis)
            continue
        flat = lax.pmean(jnp.concatenate([xs[i].reshape(-1) for i in members]), axis)
        start = 0
        for i in members:
            out[i] = flat[start:start + xs[i].size].reshape(xs[i].shape)
            start += xs[i].size
    return out


def _count_rows(trainable: list[int], rows: dict[int, tuple[int, int]]) -> tuple[np.ndarray, list[int]]:
    """For `_optim.update_all` of the parameters at `trainable` (a stack at a run's first position):
    the positions of their step counts (each layer of a stack its own) and each one's layers (0: not
    a stack)."""
    members: dict[int, list[int]] = {}
    for i, (first, row) in sorted(rows.items(), key=lambda item: item[1]):
        members.setdefault(first, []).append(i)
    positions = [i for j in trainable for i in members.get(j, [j])]
    return np.asarray(positions, np.int32), [len(members.get(j, ())) for j in trainable]


def _gradient(plan: Plan, run: Callable[..., Any], trainable: list[int] | None = None,
              rows: dict[int, tuple[int, int]] | None = None, per_micro: bool = False) -> Callable[..., Any]:
    """value_and_grad of the graph's loss in the trained parameters `own` (at layout positions
    `trainable`, the plan's by default), with the updated buffers as its auxiliary output:
    `gradient(own, params, fixed, updated, batch, key)`. `rows`: layout positions stored as a row of
    another position's stacked array (pipeline stages, `_stages`): (that position, the row).
    `per_micro`: `run` returns each output per micro-batch (pipeline parallelism); the loss is their mean."""
    slots, trainable, rows = plan.slots, plan.trainable if trainable is None else trainable, rows or {}
    update_outputs, loss_output = plan.update_outputs, plan.loss_output

    def objective(own, params, fixed, updated, batch, key):
        values = dict(zip(trainable, own))

        def param(i):
            if i in rows:
                first, row = rows[i]
                return Rows(values.get(first, params[first]), row)
            return values.get(i, params[i])

        arrays = [param(i) if kind == Feed.PARAM else fixed[i] if kind == Feed.FIXED
                  else updated[i] if kind == Feed.UPDATED else batch[i] for kind, i in slots]
        outs = run(arrays, key)
        loss = jnp.mean(outs[loss_output].astype(jnp.float32)) if per_micro else outs[loss_output].reshape(())
        return loss.astype(jnp.float32), [outs[i] for i in update_outputs]

    return jax.value_and_grad(objective, has_aux=True)


def _accumulated(gradient: Callable[..., Any], state: tuple, start: tuple, micro: list[jax.Array], key: Any,
                 accumulate: int, random: bool) -> tuple:
    """Gradients summed over the `accumulate` micro-batches (`micro`: each leaf with a leading
    micro-batch dim), one after another with each one's updated buffers feeding the next, then
    averaged: ((loss, updated), grads). `start`: (zero gradients, zero loss, the buffers)."""
    own, params, fixed = state

    def one(carry, xs):
        grads, loss, updated = carry
        i, batch = xs
        (l, new), g = gradient(own, params, fixed, updated, batch, jax.random.fold_in(key, i) if random else None)
        new = [n.astype(u.dtype) for n, u in zip(new, updated)]
        return ([a + b for a, b in zip(grads, g)], loss + l, new), None

    (grads, loss, updated), _ = lax.scan(one, start, (jnp.arange(accumulate), micro))
    return (loss / accumulate, updated), [g / accumulate for g in grads]


def _clip(grads: list[jax.Array], sharded: list[bool], max_norm: float) -> list[jax.Array]:
    """torch.nn.utils.clip_grad_norm_ on the averaged gradients (sharded rows summed over devices)."""
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads]
    replicated = sum((s for s, sh in zip(squares, sharded) if not sh), jnp.float32(0))
    split = sum((s for s, sh in zip(squares, sharded) if sh), jnp.float32(0))
    total = jnp.sqrt(replicated + (lax.psum(split, AXIS) if any(sharded) else 0.0))
    coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
    return [(g * coef).astype(g.dtype) for g in grads]


def _sequence_split(leaf: jax.Array, index: int, mesh: Any) -> jax.Array:
    """With a "context" mesh axis (context parallelism): a batch leaf of 2 or more dims with its
    dim 1, the sequence, split over that axis (a local slice: the batch arrives whole on it), so
    every activation computed from it is split the same way (attention: `ops/attention.py`)."""
    devices = dict(mesh.shape).get(CONTEXT_AXIS, 1)
    if devices == 1 or leaf.ndim < 2:
        return leaf
    if leaf.shape[1] % devices:
        raise ValueError(f"context parallelism splits dim 1 (the sequence) of every batch tensor of 2 or more dims "
                         f"over the {devices} devices of mesh axis {CONTEXT_AXIS!r}; batch tensor #{index} has shape "
                         f"{tuple(leaf.shape)}: pad its sequence to a multiple of {devices}")
    return sequence_split(leaf)


def make_global_body(plan: Plan, layout: Layout, run: Callable[..., Any], *, specs: list[Any], batch_spec: Any,
                     batch_shards: int, mesh: Any, accumulate: int, random: bool, max_norm: float | None,
                     stacking: Stacking | None = None) -> Callable[..., StepOutputs]:
    """The sharded step (`SpmdPlacement`): the same contract as `make_body`'s, traced in the global
    view for `jax.jit` with shardings. The loss is the objective of the whole global batch, as
    eager torch computes it on one machine (BatchNorm statistics too); XLA's partitioner inserts the
    parameter gathers and gradient reduce-scatters the layouts `specs` (per layout entry) imply.

    Micro-batch i of `accumulate` holds the i-th slice of every batch shard's rows, so each stays
    split over the same devices. With `stacking` (pipeline parallelism, `_stages`) the parameters
    and optimizer state of the pipelined layers come stacked (a run's first entry holds the stack,
    the others None), and `run` takes every micro-batch at once (`lower(microbatches=accumulate)`)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    rows = stacking.rows if stacking is not None else {}
    trainable = [i for i in plan.trainable if rows.get(i, (i,))[0] == i]  # each stack once, at its first entry
    entries = layout.entries
    configs = [entries[i].config for i in trainable]
    groups = [entries[i].group for i in trainable]
    grad_shardings = [NamedSharding(mesh, specs[i]) for i in trainable]
    if stacking is not None:  # every stage takes every micro-batch: split over the other batch axes only
        entry = batch_spec[0] if tuple(batch_spec) else ()
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != STAGE_AXIS)
        batch_spec = P(axes or None)
    micro_sharding = NamedSharding(mesh, P(None, *batch_spec))
    stepped = np.zeros(len(layout), np.float32)
    stepped[plan.trainable] = 1.0
    gradient = _gradient(plan, run, trainable, rows, per_micro=stacking is not None)
    count_rows, layers = _count_rows(trainable, rows)

    def micro(b):
        per = b.shape[0] // (batch_shards * accumulate)  # each batch shard's rows per micro-batch
        b = b.reshape((batch_shards, accumulate, per) + b.shape[1:]).swapaxes(0, 1)
        return lax.with_sharding_constraint(b.reshape((accumulate, batch_shards * per) + b.shape[3:]), micro_sharding)

    def accumulated(own, params, fixed, updated, batch, key):
        start = ([jnp.zeros_like(p) for p in own], jnp.float32(0), list(updated))
        return _accumulated(gradient, (own, params, fixed), start, [micro(b) for b in batch], key, accumulate,
                            random)

    def staged(own, params, fixed, updated, batch, key):
        return gradient(own, params, fixed, updated, [micro(b) for b in batch], key)

    def body(params, fixed, updated, states, counts, hyper, batch, rng, signal):
        if random:
            key, next_key = jax.random.split(jax.random.wrap_key_data(rng))
            rng = jax.random.key_data(next_key)
        else:
            key = None
        own = [params[i] for i in trainable]
        batch = [_sequence_split(b, i, mesh) for i, b in enumerate(batch)]
        grad_fn = staged if stacking is not None else gradient if accumulate == 1 else accumulated
        (loss, new_updated), grads = grad_fn(own, params, fixed, updated, batch, key)
        grads = [lax.with_sharding_constraint(g, s) for g, s in zip(grads, grad_shardings)]
        if max_norm is not None:
            grads = _clip(grads, [False] * len(grads), max_norm)
        new_params, new_states = list(params), list(states)
        updates = _optim.update_all(configs, groups, [params[i] for i in trainable], grads,
                                    [states[i] for i in trainable], hyper, counts[count_rows], layers=layers)
        for i, p, s in zip(trainable, *updates):
            new_params[i], new_states[i] = p, s
        if signal is not None:
            signal = jnp.mean(signal)
        new_updated = [n.astype(u.dtype) for n, u in zip(new_updated, updated)]
        return StepOutputs(new_params, new_updated, new_states, counts + stepped, loss.reshape(1), rng, signal)

    return body
