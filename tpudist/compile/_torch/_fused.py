"""The fused data-parallel train step for a torch.nn.Module: one XLA executable per step.

    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
    for x, y in my_batches:                 # this process's share of the global batch
        loss = step((x, y))                 # forward, backward, grad all-reduce, AdamW: one executable

`model` and `loss_fn` are captured together (`_plan.Objective`, torch.export), lowered to JAX
through the op registry, and wrapped in a per-device body (`_body`) run under `shard_map` over a
"data" axis of every device of every process. The parameters, optimizer state and updated buffers
stay on the devices between steps (`_state.Mirror`); torch's objects see them on demand, through
`state_dict()`, eager calls, `load_state_dict()` and `step.sync()`. A step hands the batch to the
executable and launches it: it returns the loss without waiting (`_lazy.LazyScalar`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import PartitionSpec as P
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpudist import _profile, _stacks
from tpudist.compile._torch import _optim
from tpudist.compile._torch._body import make_body
from tpudist.compile._torch._capture import autocast_state, capture
from tpudist.compile._torch._lazy import LazyScalar
from tpudist.compile._torch._loader import DeviceBatch, batch_rows
from tpudist.compile._torch._lower import lower
from tpudist.compile._torch._module import _leaf_key
from tpudist.compile._torch._placement import AXIS, Placement, Staging
from tpudist.compile._torch._plan import Layout, Objective, plan
from tpudist.compile._torch._pool import StatePool, flatten_state, unflatten_state
from tpudist.compile._torch._state import Mirror


@dataclass
class TrainStepStats:
    """Counters of one fused train step: `compiles` (batch signatures, train/eval modes and
    autocast settings captured and compiled; a steady loop stays at 1), `calls`, `state_reloads`
    (uploads of state that torch changed: the first step, after `load_state_dict`, after edits),
    `capture_seconds`, `compile_seconds`."""

    compiles: int = 0
    calls: int = 0
    state_reloads: int = 0
    capture_seconds: float = 0.0
    compile_seconds: float = 0.0


class TrainStep:
    """`step(batch) -> loss`: see `compile_train_step`."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, *, mesh: Any = None, max_grad_norm: float | None = None,
                 accumulate_steps: int = 1):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"compile_train_step takes a torch.nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (e.g. torch.nn.functional.cross_entropy) or None (the "
                            f"model returns its loss), got {loss_fn!r}")
        if not isinstance(accumulate_steps, int) or isinstance(accumulate_steps, bool) or accumulate_steps < 1:
            raise ValueError(f"accumulate_steps={accumulate_steps!r} must be a positive int")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a positive number or None")
        self.kind = _optim.kind_of(optimizer)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.max_grad_norm, self.accumulate_steps = max_grad_norm, accumulate_steps
        if mesh is None:
            from tpudist.mesh import make_mesh
            mesh = make_mesh({AXIS: -1})
        self.placement = Placement(mesh)
        self.mesh = mesh
        self.local_devices = self.placement.local_count
        self.stats = TrainStepStats()
        self.layout = Layout(optimizer, self.kind)
        self.mirror = Mirror(model, optimizer, self.layout, self.placement)
        self._objective = Objective(model, loss_fn)
        self._submodules = list(model.modules())
        self._programs: dict[Any, _Signature] = {}
        self._structure = self._optimizer_structure()
        # the random stream of the step's random ops (dropout): a key that stays on the devices and
        # advances inside each step, seeded from torch's default generator (see rng)
        self._rng: jax.Array | None = None
        self._rng_seed: int | None = None
        self._hyper: jax.Array | None = None
        self._hyper_rows: list[list[float]] | None = None
        self._hyper_stale = True
        self._group_values: tuple | None = None  # the param groups' values at the last step
        self._group_plain = False  # ... all plain Python values (a tensor may change in place)
        # a flag raised on any process reaches all of them with the next step's all-reduce (see
        # _body); `raise_signal()` sets it here, `signal` holds the last step's agreed value
        self._signal_raised = False
        self._signal_inputs: dict[bool, jax.Array] = {}
        self.signal: jax.Array | None = None
        self.signals = False  # whether steps take the flag at all (fit turns it on while checkpointing)
        # the last step's signature, reused while nothing it depends on changed
        self._last: tuple | None = None
        self._last_keys: tuple | None = None
        self._last_rows = 0

    def __repr__(self) -> str:
        return (f"TrainStep({type(self.model).__name__}, {type(self.optimizer).__name__}, "
                f"devices={self.mesh.devices.size}, signatures={len(self._programs)})")

    def __call__(self, batch: Any) -> LazyScalar:
        """Runs one step on this process's `batch` (`(*inputs, target)`, or with loss_fn=None what the
        model takes: a dict of keyword arguments, a tuple of positional ones; or a `DeviceBatch` from
        `tpudist.device_loader`); returns its loss (the mean over this process's devices of their
        slices' losses) as a `LazyScalar`: the step does not wait for it; reading it does."""
        if isinstance(batch, DeviceBatch):
            leaves, spec, keys, rows = batch.leaves, batch.spec, batch.keys, batch.rows
            if rows % (self.local_devices * self.accumulate_steps):
                raise ValueError(f"rank {jax.process_index()}: a device batch of {rows} examples does not split "
                                 f"into {self.accumulate_steps} micro-batches over {self.local_devices} devices")
        else:
            if self.loss_fn is not None and (not isinstance(batch, (tuple, list)) or len(batch) < 2):
                raise TypeError(f"rank {jax.process_index()}: the fused train step takes a batch (*inputs, target), "
                                f"got {type(batch).__name__}"
                                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                                + "; with loss_fn=None it takes the model's inputs, targets included")
            leaves, spec = _flatten(batch)
            keys = tuple([(t.shape, t.dtype, t.device) if type(t) is torch.Tensor else _leaf_key(t)
                          for t in leaves])
            if keys != self._last_keys:  # a batch of another shape: check it (equal shapes passed before)
                rows = batch_rows(leaves, self.local_devices * self.accumulate_steps, self.accumulate_steps)
            else:
                rows = self._last_rows
        self.stats.calls += 1
        _stacks.entered("train step")  # progress for the launcher's --hang-timeout
        flags = tuple([m.training for m in self._submodules])
        same_structure = not self._groups_changed() or self._optimizer_structure() == self._structure
        last = self._last
        if last is not None and keys == self._last_keys and flags == last[0] and spec == last[1] \
                and autocast_state() == last[2] and self.signals == last[4] and same_structure:
            return last[3](leaves, isinstance(batch, DeviceBatch))  # the same signature as the last step
        key = (flags, spec, keys, autocast_state(), self.signals)
        program = self._programs.get(key)
        if program is None or not same_structure:
            program = self._new_signature(key, spec, leaves, keys, rows)
        self._last, self._last_keys, self._last_rows = (flags, spec, key[3], program, self.signals), keys, rows
        return program(leaves, isinstance(batch, DeviceBatch))

    def sync(self) -> None:
        """Brings the model's parameters and buffers and the optimizer's state up to date with the
        devices (`state_dict()`, eager calls and `load_state_dict()` do this by themselves)."""
        self.mirror.sync()

    def state(self) -> dict[str, Any]:
        """The step's training state as it is on the devices, for `tpudist.checkpoint.save`:
        {"params", "optimizer", "counts", "buffers"}, sharded arrays staying sharded (each process
        writes its own rows). The torch objects are not read (nor written)."""
        self.mirror.prepare()
        return self.mirror.state_tree()

    def load_state(self, state: dict[str, Any]) -> None:
        """Makes `state` (from `state()`, e.g. `tpudist.checkpoint.restore(d, like=step.state())[1]`)
        the step's training state; torch's objects see it through the usual doors."""
        self.mirror.prepare()
        self.mirror.load_tree(state)

    def rng(self) -> jax.Array:
        """The random stream's key data on the devices: drawn from torch's default generator the
        first time, and again whenever `torch.manual_seed` has been called with another seed since,
        so compiled dropout is reproducible under `torch.manual_seed`; in between it advances inside
        every step."""
        seed = torch.initial_seed()
        if self._rng is None or seed != self._rng_seed:
            words = torch.randint(0, 2**32, (2,), dtype=torch.int64).numpy().astype(np.uint32)
            self._rng = self.placement.put(words, split=False)
            self._rng_seed = seed
        return self._rng

    def raise_signal(self, raised: bool = True) -> None:
        """Raise (or lower) this process's flag for the next steps; every process's `signal` (the
        agreed flag, a device array, after each step) is then positive for the step it went in."""
        self._signal_raised = raised

    def _signal_input(self) -> jax.Array:
        raised = self._signal_raised
        if raised not in self._signal_inputs:
            flags = np.full(self.local_devices, 1.0 if raised else 0.0, np.float32)
            self._signal_inputs[raised] = self.placement.put(flags, split=True)
        return self._signal_inputs[raised]

    def hyperparameters(self) -> jax.Array:
        """Every param group's row of hyperparameters on the devices, re-sent only when one changed
        (an LR schedule, a hand edit)."""
        if self._hyper_stale or self._hyper is None:
            rows = [_optim.hyper_row(self.kind, g) for g in self.optimizer.param_groups]
            if rows != self._hyper_rows:
                self._hyper_rows = rows
                self._hyper = self.placement.put(np.asarray(rows, np.float32).reshape(len(rows), _optim.FIELDS),
                                                 False)
            self._hyper_stale = False
        return self._hyper

    def _groups_changed(self) -> bool:
        """Whether any param group's values changed since the last step (one read of each; then the
        hyperparameter table is rebuilt and the optimizer's structure checked)."""
        values = tuple((id(g["params"]), len(g["params"]), *map(g.get, _GROUP_FIELDS))
                       for g in self.optimizer.param_groups)
        if self._group_plain and values == self._group_values:
            return False
        self._group_values = values
        self._group_plain = all(_plain(v) for row in values for v in row)
        self._hyper_stale = True
        return True

    def _optimizer_structure(self) -> tuple:
        """What fixes the step's layout and update rules: param groups' membership and switches
        (read every step: kept to plain values, no objects built)."""
        return tuple((id(g["params"]), len(g["params"]), g.get("momentum", 0) != 0, g.get("nesterov"),
                      g.get("maximize"), g.get("amsgrad"), g.get("decoupled_weight_decay"), g.get("differentiable"))
                     for g in self.optimizer.param_groups)

    def _new_signature(self, key: Any, spec: Any, leaves: list[Any], keys: tuple, rows: int) -> "_Signature":
        if self._optimizer_structure() != self._structure:
            # parameters added to / moved between groups, or a switch flipped: a new layout
            self.mirror.sync()
            self.mirror.close()
            self._structure = self._optimizer_structure()
            self.layout = Layout(self.optimizer, self.kind)
            self.mirror = Mirror(self.model, self.optimizer, self.layout, self.placement)
            self._programs.clear()
        # what one device traces: its share of one micro-batch (a device batch's leaves are arrays:
        # stand-in tensors of their shape and dtype)
        device_rows = rows // (self.local_devices * self.accumulate_steps)
        examples = [leaf[:device_rows] if isinstance(leaf, torch.Tensor)
                    else torch.zeros((device_rows, *k[0][1:]), dtype=k[1], device=k[2]) if isinstance(leaf, jax.Array)
                    else leaf for leaf, k in zip(leaves, keys)]
        program = self._programs[key] = _Signature(self, tree_unflatten(examples, spec))
        self.stats.compiles += 1
        return program


class _Signature:
    """The compiled step for one batch signature, train/eval mode and autocast setting."""

    def __init__(self, owner: TrainStep, example: Any):
        from tpudist.compile._jax_step import compile_jax
        self.owner = owner
        captured = capture(owner._objective, (example,), {}, where=" (or train with tpudist.eager_step)",
                           torch_autograd=False)
        owner.stats.capture_seconds += captured.seconds
        layout = owner.layout
        self.plan = plan(captured, owner._objective, layout)
        self.random = captured.has_random
        collective = _averages(owner.mesh.devices.size, layout)
        body = make_body(self.plan, layout, lower(captured), devices=owner.mesh.devices.size,
                         accumulate=owner.accumulate_steps, random=self.random, max_norm=owner.max_grad_norm,
                         collective=collective)
        if owner.mirror.pool.pooled:  # one device: the parameters and optimizer state as a pool
            body = _pooled(body, owner.mirror.pool)
            param_specs, state_specs = P(), P()
        else:
            param_specs = [P(AXIS) if e.sharded else P() for e in layout.entries]
            state_specs = [tuple(spec for _ in e.config.state) for spec, e in zip(param_specs, layout.entries)]
        split = P(AXIS) if collective else P()  # the batch and the signal: per device, or the one device's
        in_specs = (param_specs, P(), P(), state_specs, P(), P(), split, P(), split)
        out_specs = (param_specs, P(), state_specs, P(), P(AXIS), P(), P())
        self.step = compile_jax(body, mesh=owner.mesh, in_specs=in_specs, out_specs=out_specs, per_device=True,
                                donate_argnums=(0, 2, 3, 4), name=f"train step ({type(owner.model).__name__})")
        self._serialize = self.step._serialize
        self._span_name = f"tpudist.torch_step[{type(owner.model).__name__}]"
        self._executable: Any = None
        self._packing: Any = None  # the mirror's pool layout the executable was compiled for
        self._in_flight: Any = None
        self.fixed: list[jax.Array] = []
        self.updated: list[jax.Array] = []
        self._generation = -1
        self._batches: tuple[Any, Any] = (None, None)
        # small batch tensors on a CPU mesh: copied into reused device buffers (see Staging)
        tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor)]
        batch_examples = [tensors[i] for i in self.plan.batch_leaves] if len(tensors) == len(
            torch.utils._pytree.tree_leaves(example)) else []
        self._staging: Staging | None = None
        if batch_examples and all(Staging.fits(owner.placement, t) for t in batch_examples):
            rows = owner.local_devices * owner.accumulate_steps
            full = [t.new_zeros((t.shape[0] * rows, *t.shape[1:])) for t in batch_examples]
            try:
                self._staging = Staging(owner.placement, full, sets=RUN_AHEAD)
            except RuntimeError:  # this platform copies host memory on import: no reuse possible
                self._staging = None
        owner.mirror.register(self.plan.fixed, self.plan.updated)

    def __call__(self, leaves: list[Any], on_device: bool) -> LazyScalar:
        owner, mirror, plan = self.owner, self.owner.mirror, self.plan
        if mirror.torch_current or not mirror.device_current or mirror.shared:  # else nothing to do
            reloads = mirror.reloads
            mirror.prepare()
            owner.stats.state_reloads += mirror.reloads - reloads
        if mirror.owner is not self:  # another signature (or torch) last wrote the buffers
            mirror.flush_owner()
        if self._generation != mirror.generation:
            self.fixed = [mirror.named[k] for k, _ in plan.fixed]
            self.updated = [mirror.named[k] for k, _ in plan.updated]
            self._generation = mirror.generation
        put = owner.placement.put
        staged = None
        if on_device:
            batch = [leaves[i] for i in plan.batch_leaves]
        elif self._staging is not None:  # the signature fixes the dtypes the buffers were made for
            batch, staged = self._staging.put([leaves[i] for i in plan.batch_leaves])
        else:
            batch = [put(leaves[i], split=True, copy=True) for i in plan.batch_leaves]
        rng = owner.rng() if self.random else None
        params, states = mirror.pool.step_arrays()
        args = (params, self.fixed, self.updated, states, mirror.counts, owner.hyperparameters(),
                batch, rng, owner._signal_input() if owner.signals else None)
        if self._executable is None or self._packing is not mirror.pool.packing:
            self._packing = mirror.pool.packing  # (a pool of other shapes or dtypes: compiled again)
            self._executable = self.step.compiled(*args)
            owner.stats.compile_seconds += self.step.stats.compile_seconds
        if self._serialize and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)  # see CompiledStep: multi-device CPU steps must not overlap
        if _profile.active:
            with _profile.span(self._span_name, call=owner.stats.calls):
                params, self.updated, states, counts, losses, rng, owner.signal = self._executable(*args)
        else:
            params, self.updated, states, counts, losses, rng, owner.signal = self._executable(*args)
        self._in_flight = losses
        if staged is not None:
            self._staging.used(staged, losses)
        else:
            # imported batch buffers are torch's: released here two steps on, when XLA is done with
            # them, rather than by XLA's thread as the step ends (it would wait for this thread's GIL)
            self._batches = (batch, self._batches[0])
        mirror.stepped(params, states, counts, self)
        self._generation = mirror.generation
        if self.random:
            owner._rng = rng
        # what torch.optim's step wrapper records, read by LR schedulers' "lr_scheduler.step()
        # before optimizer.step()" warning: the update did run, inside the executable
        owner.optimizer._opt_called = True  # type: ignore[attr-defined]
        return LazyScalar(losses)


def _pooled(body: Callable[..., Any], state: StatePool) -> Callable[..., Any]:
    """`body` taking and returning the parameters and optimizer state as the pool (see `_pool`),
    cut into arrays as the step starts and packed again as it ends, in the pool's layout when the
    step is traced."""
    def pooled(pool, fixed, updated, _states, *rest):
        packing = state.packing
        params, states = unflatten_state(packing.split(pool), state.layout)
        params, updated, states, *outs = body(params, fixed, updated, states, *rest)
        # each array back in the dtype its place in the pool has, so the pool keeps its layout
        flat = [a.astype(dtype) for a, dtype in zip(flatten_state(params, states), packing.dtypes)]
        return (packing.pack(flat), updated, [], *outs)

    return pooled


RUN_AHEAD = 8  # staged batches in flight: how many steps the host may run ahead of the device (see Staging)


# what a param group holds besides its parameters (any optimizer the fused step implements)
_GROUP_FIELDS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "betas", "eps", "amsgrad",
                 "decoupled_weight_decay", "differentiable")


def _plain(value: Any) -> bool:
    """A value that compares by value and cannot change in place (not a tensor)."""
    if type(value) is tuple:
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float)


def _flatten(batch: Any) -> tuple[list[Any], Any]:
    """The batch's leaves (numpy arrays as tensors) and structure; a tuple of tensors (the common
    case) without walking the pytree machinery."""
    if type(batch) is tuple and all(type(t) is torch.Tensor for t in batch):
        spec = _TUPLE_SPECS.get(len(batch))
        if spec is None:
            spec = _TUPLE_SPECS[len(batch)] = tree_flatten(batch)[1]
        return list(batch), spec
    leaves, spec = tree_flatten(batch)
    return [torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in leaves], spec


_TUPLE_SPECS: dict[int, Any] = {}


def compile_train_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                       optimizer: torch.optim.Optimizer, *, mesh: Any = None,
                       max_grad_norm: float | None = None, accumulate_steps: int = 1) -> TrainStep:
    """The fused data-parallel step: forward, backward, the gradient all-reduce and the optimizer
    update in ONE XLA executable. Returns `step(batch) -> loss`; `fit` uses it by default.

    `batch` is this process's `(*inputs, target)`; the step runs `loss_fn(model(*inputs), target)`
    (captured together with torch.export; `loss_fn` must return a mean-reduced scalar). With
    `loss_fn=None` the model computes its own loss, as Hugging Face models do when the batch holds
    `labels`: the batch is what the model takes (a dict: `model(**batch)`; a tuple: `model(*batch)`)
    and the loss is `output.loss` (or `output["loss"]`, `output[0]`, or the output itself). It averages
    the gradients over every device of every process in-graph, and applies `optimizer`'s update
    inside the executable: torch.optim.SGD (momentum, dampening, nesterov, weight decay, maximize),
    Adam (amsgrad, weight decay) and AdamW, matching torch.optim's numbers. Hyperparameters are read
    from `optimizer.param_groups` on every step (LR schedulers work, no recompile). `.grad` is not
    filled. `max_grad_norm` clips the averaged gradients of the parameters it trains, like
    `torch.nn.utils.clip_grad_norm_` over them. `mesh` defaults to every device of every process on
    one "data" axis; each process's batch is split over its own devices (BatchNorm statistics are
    per device, as with DDP; the running statistics are averaged over devices after each step).

    State lives on the devices: parameters, optimizer state and BatchNorm statistics stay device
    arrays between steps, and no step copies anything to the host. The model and optimizer see the
    current values when read through `model.state_dict()`, `optimizer.state_dict()`, an eager call
    of the model, or `step.sync()`; `load_state_dict()` and changes made from torch after such a
    read are used by the next step. The step returns its loss without waiting (a `LazyScalar`;
    reading it waits). `tpudist.device_loader` moves batches to the devices ahead of the step.

    `accumulate_steps=K` splits each device's share of the batch into K micro-batches, run one after
    another inside the executable, and averages their gradients before one update: the same update
    as one step on the whole batch (for a mean-reduced loss), in the memory of one micro-batch.

    Random ops (dropout) draw from a key that lives on the devices and advances every step, folded
    with each device's position, seeded from torch's default generator when the step first runs (so
    `torch.manual_seed` before it makes the run reproducible). `torch.autocast` around a call is
    honoured: the step is captured inside the same autocast (bf16 matmuls, fp32 parameters).

    `tpudist.nn.ShardedEmbedding` layers train inside the step: their lookups become in-graph
    collectives. A new batch shape, train/eval mode or autocast setting compiles once more (`step.stats`).

        step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
        loss = step((x_local, y_local))
        step = tpudist.compile_train_step(bert, None, opt)          # Hugging Face: the model's loss
        loss = step({"input_ids": ids, "attention_mask": mask, "labels": labels})
    """
    return TrainStep(model, loss_fn, optimizer, mesh=mesh, max_grad_norm=max_grad_norm,
                     accumulate_steps=accumulate_steps)


def _averages(devices: int, layout: Any) -> bool:
    """Whether the step averages its gradients over the devices in an all-reduce.

    Not on one device with nothing sharded (see make_body), except where a trained parameter has
    3 or more dims (convolution kernels): XLA:CPU's convolutions give their kernel gradients in
    its own layout, and without the all-reduce in between it fuses the transpose into torch's
    layout into the optimizer update as a strided read; measured 5% slower on ResNet-18 than
    the all-reduce's separate, tiled transpose."""
    if devices > 1 or any(e.sharded for e in layout.entries):
        return True
    return any(e.param.ndim >= 3 for e in layout.entries)
