"""The fused data-parallel train step for a torch.nn.Module: one XLA executable per step.

    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
    for x, y in my_batches:                 # this process's share of the global batch
        loss = step((x, y))                 # forward, backward, grad all-reduce, AdamW: one executable

`model` and `loss_fn` are captured together (`_plan.Objective`, torch.export), lowered to JAX
through the op registry, and wrapped in a per-device body (`_body`) run under `shard_map` over a
"data" axis of every device of every process: one `_signature.Signature` per batch signature.
The parameters, optimizer state and updated buffers stay on the devices between steps
(`_state.Mirror`); torch's objects see them on demand, through `state_dict()`, eager calls,
`load_state_dict()`, `step.sync()` and any read of a trained tensor (`_stale`). A step hands the
batch to the executable and launches it: it returns the loss without waiting (`_lazy.LazyScalar`).

`TrainStep` owns the step's lifecycle: a signature's call returns the executable's
`StepOutputs` (new state, updated buffers, loss, key, flag), and `TrainStep` alone applies them
to the mirror, to its own key and flag, and to the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
import torch
from jax.sharding import Mesh, PartitionSpec as P
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

import tpudist._stacks as _stacks
from tpudist.compile._torch.train import _optim
from tpudist.compile._torch.lowering._capture import autocast_state
from tpudist.compile._torch.train._lazy import LazyScalar
from tpudist.compile._torch.train._loader import DeviceBatch, batch_rows
from tpudist.compile._torch._layout import step_placement
from tpudist.compile._torch.train._memory import StepMemory, step_memory
from tpudist.compile._torch._stats import CaptureStats
from tpudist.compile._torch.lowering._observed import recaptured
from tpudist.compile._torch._sync import leaf_key
from tpudist.compile._torch._custom_ops import SHARDED_ATTR
from tpudist.compile._torch._placement import Placement, SpmdPlacement
from tpudist.compile._torch._sharding import Sharding, describe
from tpudist.compile._torch.train._groups import ParamGroups
from tpudist.compile._torch.train._plan import Objective
from tpudist.compile._torch.train._signature import Signature
from tpudist.compile._torch.train._state import Mirror


@dataclass
class TrainStepStats(CaptureStats):
    """Counters of one fused train step: `compiles` (batch signatures, train/eval modes and
    autocast settings captured and compiled; a steady loop stays at 1), `calls`, `capture_seconds`
    (see `CaptureStats`), `state_reloads` (uploads of state that torch changed: the first step,
    after `load_state_dict`, after edits), `compile_seconds`, `flops_per_step` (the matmul and
    convolution FLOPs one device runs in the step the last call ran: forward and backward of
    every micro-batch, each layer of a scanned stack; None before the first step or where a loop's
    trip count is unknown; `fit` reports MFU from it)."""

    state_reloads: int = 0
    compile_seconds: float = 0.0
    flops_per_step: float | None = None

    def compiled(self, seconds: float) -> None:
        """Told by each signature when its executable compiles (its `on_compile`)."""
        self.compile_seconds += seconds


class TrainStep:
    """`step(batch) -> loss`: see `compile_train_step`."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, *, mesh: Mesh | None = None,
                 max_grad_norm: float | None = None, accumulate_steps: int = 1, sharding: Any = None):
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
        self.sharding, self.placement, self._specs, preloaded = step_placement(model, mesh, sharding)
        self.mesh = self.placement.mesh
        self.local_devices = self.placement.local_count
        self.stats = TrainStepStats()
        self.groups = ParamGroups(optimizer, self.kind, self.placement)
        self.layout = self.groups.new_layout()
        self.mirror = Mirror(model, optimizer, self.layout, self.placement)
        if preloaded:
            self.mirror.start_from(preloaded)
        self._objective = Objective(model, loss_fn)
        self._submodules = list(model.modules())
        self._programs: dict[tuple, Signature] = {}
        # the random stream of the step's random ops (dropout): a key that stays on the devices and
        # advances inside each step, seeded from torch's default generator (see rng)
        self._rng: jax.Array | None = None
        self._rng_seed: int | None = None
        # a flag raised on any process reaches all of them with the next step's all-reduce (see
        # _body); `raise_signal()` sets it here, `signal` holds the last step's agreed value
        self._signal_raised = False
        self._signal_inputs: dict[bool, jax.Array] = {}
        self.signal: jax.Array | None = None
        self.signals = False  # whether steps take the flag at all (fit turns it on while checkpointing)
        # the last step's signature, reused while nothing it depends on changed
        self._last: _Last | None = None
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
            keys = tuple([(t.shape, t.dtype, t.device) if type(t) is torch.Tensor else leaf_key(t)
                          for t in leaves])
            if keys != self._last_keys:  # a batch of another shape: check it (equal shapes passed before)
                rows = batch_rows(leaves, self.local_devices * self.accumulate_steps, self.accumulate_steps)
            else:
                rows = self._last_rows
        self.stats.calls += 1
        _stacks.entered("train step")  # progress for the launcher's --hang-timeout
        flags = tuple([m.training for m in self._submodules] + [e.param.requires_grad for e in self.layout.entries])
        same_structure = not self.groups.changed() or not self.groups.restructured()
        last = self._last
        if last is not None and keys == self._last_keys and flags == last.flags and spec == last.spec \
                and autocast_state() == last.autocast and self.signals == last.signals and same_structure \
                and not self._changed(last.program, leaves, batch):
            return self._run(last.program, leaves, isinstance(batch, DeviceBatch))  # the last step's signature
        key = (flags, spec, keys, autocast_state(), self.signals)
        program = self._programs.get(key)
        if program is not None and self._changed(program, leaves, batch):
            recaptured(self.stats, program.guard, type(self.model).__name__)
            program = None
        if program is None or not same_structure:
            program = self._new_signature(key, spec, leaves, keys, rows)
        self._last, self._last_keys, self._last_rows = _Last(flags, spec, key[3], program, self.signals), keys, rows
        return self._run(program, leaves, isinstance(batch, DeviceBatch))

    def _changed(self, program: Signature, leaves: list[Any], batch: Any) -> bool:
        """Whether a data-dependent value `program` specialised on differs for this batch."""
        if program.guard is None:
            return False
        if isinstance(batch, DeviceBatch):
            raise TypeError(f"{type(self.model).__name__} computes shapes or branches from its inputs, checked on the "
                            "host before each step; pass host batches, not a tpudist.device_loader's")
        return not program.guard.holds(leaves, self.local_devices * self.accumulate_steps)

    def _run(self, program: Signature, leaves: list[Any], on_device: bool) -> LazyScalar:
        """One step of `program`, whose outputs this applies: the only writer of the step's state."""
        mirror = self.mirror
        if mirror.torch_current or not mirror.device_current or mirror.shared:  # else nothing to do
            reloads = mirror.reloads
            mirror.prepare()
            self.stats.state_reloads += mirror.reloads - reloads
        out = program(leaves, on_device, self.groups.hyperparameters(), self.rng() if program.random else None,
                      self._signal_input() if self.signals else None, self.stats.calls)
        mirror.stepped(out.params, out.states, out.counts, program)
        self.stats.flops_per_step = program.flops
        if program.random:
            self._rng = out.rng
        self.signal = out.signal
        # what torch.optim's step wrapper records, read by LR schedulers' "lr_scheduler.step()
        # before optimizer.step()" warning: the update did run, inside the executable
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return LazyScalar(out.loss)

    def shardings(self) -> dict[str, Any]:
        """Each parameter's (and its optimizer state's) layout over the mesh by name; a pipelined run's
        stacks after the first step as one name each ("model.layers.*.mlp.up.weight": P("stage"))."""
        return describe(self.model, self._specs, P(AXIS) if self.sharding is None else None, self.mirror.pool)

    def memory(self) -> StepMemory:
        """Bytes per device of the step's state, and XLA's estimate of the current executable's peak."""
        return step_memory(self.mirror, self._last.program.executable if self._last is not None else None)

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

    def rng_key(self) -> jax.Array | None:
        """The random stream's key data as it stands (None before a step drew one), for checkpoints."""
        return self._rng

    def restore_rng_key(self, key: np.ndarray) -> None:
        """Makes `key` (two uint32 words from a checkpoint) the random stream's key under the
        current torch seed."""
        self._rng = self.placement.put(key, split=False)
        self._rng_seed = torch.initial_seed()

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

    def _new_signature(self, key: tuple, spec: TreeSpec, leaves: list[Any], keys: tuple, rows: int) -> Signature:
        if self.groups.restructured():
            # parameters added to / moved between groups, or a switch flipped: a new layout
            self.mirror.sync()
            self.mirror.close()
            self.layout = self.groups.new_layout()
            self.mirror = Mirror(self.model, self.optimizer, self.layout, self.placement)
            self._programs.clear()
        examples = _examples(leaves, keys, rows // (self.local_devices * self.accumulate_steps), self.placement)
        with self.mirror.unmarked():  # the capture traces the model: plain tensors, stale values are fine
            program = Signature(self._objective, tree_unflatten(examples, spec), layout=self.layout,
                                mirror=self.mirror, placement=self.placement, accumulate=self.accumulate_steps,
                                max_grad_norm=self.max_grad_norm, name=type(self.model).__name__,
                                on_compile=self.stats.compiled)
        self._programs[key] = program
        self.stats.capture_seconds += program.capture_seconds
        self.stats.compiles += 1
        return program


def _examples(leaves: list[Any], keys: tuple, device_rows: int, placement: Any) -> list[Any]:
    """What a signature traces: one device's share of one micro-batch, or in the global view every
    batch shard's (this process's rows, repeated); a device batch's arrays become stand-in tensors
    of their shape and dtype."""
    if placement.spmd:
        device_rows, leaves = device_rows * placement.batch_shards, [
            _tiled(leaf, device_rows, placement.batch_shards) for leaf in leaves]
    return [leaf[:device_rows] if isinstance(leaf, torch.Tensor)
            else torch.zeros((device_rows, *k[0][1:]), dtype=k[1], device=k[2]) if isinstance(leaf, jax.Array)
            else leaf for leaf, k in zip(leaves, keys)]


def _tiled(leaf: Any, rows: int, times: int) -> Any:
    """A stand-in for the global micro-batch: this process's first `rows` rows, `times` times."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf[:rows].repeat(times, *([1] * (leaf.dim() - 1)))


class _Last(NamedTuple):
    """What the last step's signature was chosen by (checked first: a steady loop's whole lookup)."""

    flags: tuple[bool, ...]  # train/eval modes, then which parameters train (a layer frozen between steps)
    spec: TreeSpec
    autocast: tuple
    program: Signature
    signals: bool


def _flatten(batch: Any) -> tuple[list[Any], TreeSpec]:
    """The batch's leaves (numpy arrays as tensors) and structure; a tuple of tensors (the common
    case) without walking the pytree machinery."""
    if type(batch) is tuple and all(type(t) is torch.Tensor for t in batch):
        spec = _TUPLE_SPECS.get(len(batch))
        if spec is None:
            spec = _TUPLE_SPECS[len(batch)] = tree_flatten(batch)[1]
        return list(batch), spec
    leaves, spec = tree_flatten(batch)
    return [torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in leaves], spec


_TUPLE_SPECS: dict[int, TreeSpec] = {}


def compile_train_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                       optimizer: torch.optim.Optimizer, *, mesh: Mesh | None = None,
                       max_grad_norm: float | None = None, accumulate_steps: int = 1,
                       sharding: Any = None) -> TrainStep:
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
    current values when read: through `model.state_dict()`, `optimizer.state_dict()`, an eager call
    of the model, `step.sync()`, or any torch read of a trained tensor (`p.data`, `p.clone()`,
    `optimizer.state[p]`: the first one syncs); `load_state_dict()` and changes made from torch
    after such a read are used by the next step. The step returns its loss without waiting (a
    `LazyScalar`; reading it waits). `tpudist.device_loader` moves batches to the devices ahead of the step.

    `accumulate_steps=K` splits each device's share of the batch into K micro-batches, run one after
    another inside the executable, and averages their gradients before one update: the same update
    as one step on the whole batch (for a mean-reduced loss), in the memory of one micro-batch.
    On a mesh with a "stage" axis they are the pipeline's micro-batches (docs/sharding.md).

    Random ops (dropout) draw from a key that lives on the devices and advances every step, folded
    with each device's position, seeded from torch's default generator when the step first runs (so
    `torch.manual_seed` before it makes the run reproducible). `torch.autocast` around a call is
    honoured: the step is captured inside the same autocast (bf16 matmuls, fp32 parameters).

    `sharding=` shards the parameters and optimizer state over `mesh` (models bigger than one device;
    docs/sharding.md): "fsdp" (ZeRO-3 over the mesh's "fsdp" axis), a tensor-parallel preset
    ("llama", "gpt2") or plan ({"*.q_proj": "colwise", "*.lm_head.weight": PartitionSpec("model",
    None)}), or `tpudist.Sharding(fsdp=True, tp="llama")` on a 2-D mesh. The step is then compiled in
    the global view (XLA's SPMD partitioner): the loss is the global batch's, as eager torch gives on
    one machine, BatchNorm statistics are the global batch's, and `state_dict()` gathers full tensors
    (a collective: every process reads it). `step.shardings()` says where each parameter went.

    `tpudist.nn.ShardedEmbedding` layers train inside the data-parallel step: their lookups become
    in-graph collectives. A new batch shape, train/eval mode or autocast setting compiles once more (`step.stats`).

        step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
        loss = step((x_local, y_local))
        step = tpudist.compile_train_step(bert, None, opt)          # Hugging Face: the model's loss
        loss = step({"input_ids": ids, "attention_mask": mask, "labels": labels})
    """
    return TrainStep(model, loss_fn, optimizer, mesh=mesh, max_grad_norm=max_grad_norm,
                     accumulate_steps=accumulate_steps, sharding=sharding)
