"""The fused data-parallel train step for a torch.nn.Module: one XLA executable per step.

    step = tpudist.compile_train_step(model, F.cross_entropy, torch.optim.AdamW(model.parameters()))
    for x, y in my_batches:                 # this process's share of the global batch
        loss = step((x, y))                 # forward, backward, grad all-reduce, AdamW: one executable

`model` and `loss_fn` are captured together (torch.export of `loss_fn(model(*inputs), target)`),
lowered to JAX through the op registry, and wrapped in a per-device step run under `shard_map`
over a "data" axis made of every device of every process: each device differentiates its slice of
the batch, `pmean` averages the gradients in-graph (one all-reduce), and the optimizer's update
(`_optim`) runs on every device on the averaged gradients. Rows of `tpudist.nn.ShardedEmbedding`
are split over the devices instead and their lookups are in-graph collectives.

State: between steps the parameters and the optimizer's state are global JAX arrays, and the
model's parameters (`p.data`) and `optimizer.state` are zero-copy torch views of them, so the model
and optimizer always hold the current values (evaluate, checkpoint, `state_dict()` at any time).
A parameter or state tensor changed from torch between steps (`load_state_dict`, in-place init,
`optimizer.load_state_dict`) is noticed (tensor identity, storage and version) and read again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from torch.utils._pytree import tree_flatten

from tpudist.compile._torch import _optim
from tpudist.compile._torch._capture import autocast_state, capture
from tpudist._jaxcompat import import_buffer
from tpudist._jaxcompat import assemble
from tpudist.compile._torch._convert import to_jax, to_torch
from tpudist.compile._torch._lower import lower
from tpudist.compile._torch._module import _leaf_key
from tpudist.compile._torch._program import _resolver
from tpudist.compile._torch.ops.collective import over_axis
from tpudist.compile._torch._custom_ops import SHARDED_ATTR

AXIS = "data"


@dataclass
class TrainStepStats:
    """Counters of one fused train step: `compiles` (batch signatures and train/eval modes
    captured and compiled; a steady loop stays at 1), `calls`, `state_reloads` (parameters or
    optimizer state re-read from torch because they were changed between steps),
    `capture_seconds`, `compile_seconds`."""

    compiles: int = 0
    calls: int = 0
    state_reloads: int = 0
    capture_seconds: float = 0.0
    compile_seconds: float = 0.0


class _Objective(torch.nn.Module):
    """The loss of one batch as one module, so one export captures model and loss together:
    `loss_fn(model(*batch[:-1]), batch[-1])`, or with no loss_fn the loss the model computes itself
    (`model(**batch).loss` for a dict batch, as Hugging Face models do when given `labels`)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # registered as a submodule when it is one (nn.CrossEntropyLoss())

    def forward(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model(*batch[:-1]), batch[-1])
        return model_loss(call_model(self.model, batch))


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """`model(**batch)` for a mapping, `model(*batch)` for a tuple or list, else `model(batch)`."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: `output.loss` (a Hugging Face `ModelOutput`), `output["loss"]`,
    the first element of a tuple, or the output itself when it is a tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn=None: the model returned {type(output).__name__} with no loss; put the "
                         "targets in the batch (e.g. {'input_ids': ..., 'labels': ...} for a Hugging Face "
                         "model) or pass loss_fn=")
    return loss


class _Tracked:
    """A global array we hold for a torch tensor, and how to tell whether torch changed it since."""

    __slots__ = ("array", "view", "ptr", "version")

    def __init__(self, array: jax.Array, view: torch.Tensor):
        self.array, self.view = array, view
        self.ptr, self.version = view.data_ptr(), view._version

    def fresh(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() == self.ptr and tensor._version == self.version


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
        self.max_grad_norm = max_grad_norm
        self.accumulate_steps = accumulate_steps
        if mesh is None:
            from tpudist.mesh import make_mesh
            mesh = make_mesh({AXIS: -1})
        if tuple(mesh.axis_names) != (AXIS,):
            raise ValueError(f"the fused train step runs data-parallel over a 1-D mesh with axis {AXIS!r}; "
                             f"got axes {tuple(mesh.axis_names)} (tpudist.mesh.make_mesh({{'data': -1}}))")
        self.mesh = mesh
        me = jax.process_index()
        self.local_devices = sum(1 for d in mesh.devices.flat if d.process_index == me)
        self.stats = TrainStepStats()
        self._objective = _Objective(model, loss_fn)
        self._submodules = list(model.modules())
        self._programs: dict[Any, _FusedProgram] = {}
        self._tracked: dict[tuple[int, str], _Tracked] = {}  # (id(param), "param" | state name)
        # the random stream of the step's random ops (dropout): a key that stays on the devices and
        # advances inside each step, seeded from torch's default generator (see rng)
        self._rng: jax.Array | None = None
        self._rng_seed: int | None = None

    def __repr__(self) -> str:
        return (f"TrainStep({type(self.model).__name__}, {type(self.optimizer).__name__}, "
                f"devices={self.mesh.devices.size}, signatures={len(self._programs)})")

    def __call__(self, batch: Any) -> torch.Tensor:
        """Runs one step on this process's `batch` (`(*inputs, target)`, or with loss_fn=None what the
        model takes: a dict of keyword arguments, a tuple of positional ones); returns its loss (the mean
        over this process's devices of their slices' losses, a 0-d float32 tensor on the model's device;
        on a GPU the step does not wait for it, so `loss.item()` is where the host waits)."""
        rank = jax.process_index()
        if self.loss_fn is not None and (not isinstance(batch, (tuple, list)) or len(batch) < 2):
            raise TypeError(f"rank {rank}: the fused train step takes a batch (*inputs, target), got "
                            f"{type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                            + "; with loss_fn=None it takes the model's inputs, targets included")
        leaves, spec = tree_flatten(batch)
        tensors = [torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in leaves]
        rows = self._rows(tensors, rank)
        self.stats.calls += 1
        key = (tuple(m.training for m in self._submodules), spec, tuple(_leaf_key(t) for t in tensors),
               self._optimizer_key(), autocast_state())
        program = self._programs.get(key)
        if program is None:
            device_rows = rows // (self.local_devices * self.accumulate_steps)
            program = self._programs[key] = _FusedProgram(self, spec, tensors, device_rows)
            self.stats.compiles += 1
        return program(tensors)

    def rng(self, make_global: Callable[[np.ndarray], jax.Array]) -> jax.Array:
        """The random stream's key data on the devices: drawn from torch's default generator the
        first time, and again whenever `torch.manual_seed` has been called since, so compiled dropout
        is reproducible under `torch.manual_seed`; in between it advances inside every step."""
        seed = torch.initial_seed()
        if self._rng is None or seed != self._rng_seed:
            words = torch.randint(0, 2**32, (2,), dtype=torch.int64).numpy().astype(np.uint32)
            self._rng = make_global(words)
            self._rng_seed = seed
        return self._rng

    def _rows(self, tensors: list[Any], rank: int) -> int:
        shaped = [t for t in tensors if isinstance(t, torch.Tensor)]
        if not shaped or any(t.ndim == 0 for t in shaped):
            raise ValueError(f"rank {rank}: every tensor of a batch needs a leading batch dimension; got shapes "
                             f"{[tuple(t.shape) for t in shaped]}")
        rows = {int(t.shape[0]) for t in shaped}
        if len(rows) != 1:
            raise ValueError(f"rank {rank}: the batch's tensors have different leading sizes {sorted(rows)}; "
                             "they must all be this process's examples")
        (n,) = rows
        parts = self.local_devices * self.accumulate_steps
        if n == 0 or n % parts:
            split = (f"{self.local_devices} devices" + (f" x {self.accumulate_steps} micro-batches"
                                                        if self.accumulate_steps > 1 else ""))
            raise ValueError(f"rank {rank}: a batch of {n} examples cannot be split evenly over this process's "
                             f"{split}; use a per-process batch size that is a multiple of {parts} "
                             "(e.g. DataLoader(drop_last=True))")
        return n

    def _optimizer_key(self) -> tuple:
        return tuple((tuple(id(p) for p in g["params"]), _optim.config(self.kind, self.optimizer, g))
                     for g in self.optimizer.param_groups)


def compile_train_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                       optimizer: torch.optim.Optimizer, *, mesh: Any = None,
                       max_grad_norm: float | None = None, accumulate_steps: int = 1) -> "TrainStep":
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
    from `optimizer.param_groups` on every step (LR schedulers work, no recompile); afterwards the
    model's parameters and `optimizer.state` hold the new values (views of XLA's buffers), so
    evaluation, `state_dict()` and checkpoints work between steps, and changes made from torch
    between steps are picked up. `.grad` is not filled. `max_grad_norm` clips the averaged
    gradients of the parameters it trains, like `torch.nn.utils.clip_grad_norm_` over them.
    `mesh` defaults to every device of every process on one "data" axis; each process's batch is
    split over its own devices (BatchNorm statistics are per device, as with DDP; the running
    statistics are averaged over devices after each step).

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



class _FusedProgram:
    """The compiled step for one batch signature and train/eval mode."""

    def __init__(self, owner: TrainStep, spec: Any, tensors: list[Any], device_rows: int):
        from tpudist.compile._jax_step import compile_jax
        self.owner = owner
        example = [t[:device_rows] if isinstance(t, torch.Tensor) else t for t in tensors]
        batch = torch.utils._pytree.tree_unflatten(example, spec)
        captured = capture(owner._objective, (batch,), {})
        owner.stats.capture_seconds += captured.seconds
        self.captured = captured
        losses = [i for i, o in enumerate(captured.outputs) if o.kind == "user"]
        output = next(n for n in captured.graph.nodes if n.op == "output").args[0]
        loss_node = output[losses[0]] if len(losses) == 1 else None
        loss_val = loss_node.meta.get("val") if isinstance(loss_node, torch.fx.Node) else None
        if len(losses) != 1 or not isinstance(loss_val, torch.Tensor) or loss_val.numel() != 1 \
                or not loss_val.dtype.is_floating_point:
            raise ValueError(f"loss_fn must return one floating scalar (e.g. a mean-reduced loss); it returned "
                             f"{getattr(loss_val, 'shape', loss_val)!r}")
        self.loss_position = losses[0]
        self.buffer_outputs = [(i, o.target) for i, o in enumerate(captured.outputs) if o.kind == "buffer"]
        if any(o.kind == "input" for o in captured.outputs):
            raise ValueError("the model writes into its inputs in place; the fused step cannot return that")
        # every tensor input of the graph, in order: trainable params, other (read-only) state,
        # or batch leaves
        group_of = {id(p): (i, g) for i, g in enumerate(owner.optimizer.param_groups) for p in g["params"]}
        objective = owner._objective
        self.slots: list[tuple[str, Any]] = []
        self.trainable: list[tuple[Callable[[], torch.Tensor], _optim.ParamConfig, int]] = []
        self.others: list[Callable[[], torch.Tensor]] = []
        self.batch_leaves: list[int] = []
        getters, other_position = {}, {}
        for slot in captured.inputs:
            if slot.kind == "literal":
                continue
            if slot.kind == "input":
                self.slots.append(("batch", len(self.batch_leaves)))
                self.batch_leaves.append(slot.leaf)
                continue
            get = getters[slot.name] = functools.partial(_resolver(objective, slot, captured), None)
            tensor = get()
            entry = group_of.get(id(tensor)) if slot.kind == "param" else None
            if entry is not None and slot.used and tensor.requires_grad:
                if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise TypeError(f"parameter {slot.name[len('model.'):]} is {tensor.dtype}; the fused step "
                                    "trains float32 / bfloat16 / float16 parameters (model.float())")
                group_index, group = entry
                cfg = _optim.config(owner.kind, owner.optimizer, group)
                self.slots.append(("param", len(self.trainable)))
                self.trainable.append((get, cfg, group_index))
            else:
                other_position[slot.name] = len(self.others)
                self.slots.append(("other", len(self.others)))
                self.others.append(get)
        self.sharded = [bool(getattr(get(), SHARDED_ATTR, False)) for get, _, _ in self.trainable]
        other_sharded = [bool(getattr(get(), SHARDED_ATTR, False)) for get in self.others]
        if any(other_sharded):
            raise ValueError("a ShardedEmbedding weight is frozen or not in the optimizer; the fused step "
                             "only handles sharded weights it trains")
        if not self.trainable:
            raise ValueError("the fused step found no parameter to train: none of the model's parameters that "
                             "the loss uses is in the optimizer with requires_grad=True")
        self.configs = tuple(cfg for _, cfg, _ in self.trainable)
        # the buffers the graph updates (BatchNorm statistics), read like its other inputs
        self.buffer_getters = [getters[target] for _, target in self.buffer_outputs]
        self.buffer_others = [other_position[target] for _, target in self.buffer_outputs]
        self.has_random = captured.has_random
        self._no_rng: jax.Array | None = None
        run = lower(captured)
        body = self._body(run)
        param_specs = [P(AXIS) if s else P() for s in self.sharded]
        state_specs = [tuple(spec for _ in cfg.state) for spec, cfg in zip(param_specs, self.configs)]
        in_specs = (param_specs, P(), state_specs, P(), P(AXIS), P())
        out_specs = (param_specs, P(), state_specs, P(AXIS), P())
        self.step = compile_jax(body, mesh=owner.mesh, in_specs=in_specs, out_specs=out_specs,
                                per_device=True, name=f"train step ({type(owner.model).__name__})")
        self._executable: Any = None
        # the hyperparameter table last sent to the devices, and the rows it was made from
        self._hyper: Any = None
        self._hyper_rows: list[list[float]] | None = None
        # arguments are made global here, directly from this process's pieces (faster per step than
        # the general path of compile_jax); this needs the processes' devices in process-major
        # order along "data", which is how make_mesh lays out one axis
        mesh, me = owner.mesh, jax.process_index()
        order = list(mesh.devices.flat)
        self._devices = [d for d in order if d.process_index == me]
        first = order.index(self._devices[0])
        if order[first:first + len(self._devices)] != self._devices:
            raise ValueError(f"rank {me}: this process's devices are not contiguous along the mesh's "
                             f"{AXIS!r} axis; build the mesh with tpudist.mesh.make_mesh({{{AXIS!r}: -1}})")
        self._replicated = NamedSharding(mesh, P())
        self._split = NamedSharding(mesh, P(AXIS))
        self._total = mesh.devices.size

    def _body(self, run: Callable[..., Any]) -> Callable[..., Any]:
        slots, configs, sharded = self.slots, self.configs, self.sharded
        loss_position = self.loss_position
        buffer_positions, buffer_others = [i for i, _ in self.buffer_outputs], self.buffer_others
        max_norm = self.owner.max_grad_norm
        devices = self.owner.mesh.devices.size
        micro_batches, random = self.owner.accumulate_steps, self.has_random

        def objective(params, others, batch, key):
            arrays = [params[i] if kind == "param" else others[i] if kind == "other" else batch[i]
                      for kind, i in slots]
            outs = run(arrays, key)
            return outs[loss_position].reshape(()).astype(jnp.float32), [outs[i] for i in buffer_positions]

        gradient = jax.value_and_grad(objective, has_aux=True)

        def accumulate(own, others, batch, key):
            """Gradients summed over `micro_batches` slices of the batch, run one after another (the
            updated BatchNorm statistics of one feed the next, as K eager forwards do), then averaged."""
            micro = [b.reshape((micro_batches, b.shape[0] // micro_batches) + b.shape[1:]) for b in batch]
            others = list(others)
            for j in buffer_others:  # replicated inputs; their updates are per device
                others[j] = lax.pcast(others[j], AXIS, to="varying")

            def one(carry, xs):
                grads, loss, others = carry
                i, batch = xs
                (l, buffers), g = gradient(own, others, batch, jax.random.fold_in(key, i) if random else None)
                others = list(others)
                for j, b in zip(buffer_others, buffers):
                    others[j] = b.astype(others[j].dtype)
                return ([a + b for a, b in zip(grads, g)], loss + l, others), None

            zeros = [jnp.zeros_like(p) for p in own]  # of `own`: already per device
            (grads, loss, others), _ = lax.scan(one, (zeros, lax.pcast(jnp.float32(0), AXIS, to="varying"), others),
                                                (jnp.arange(micro_batches), micro))
            return (loss / micro_batches, [others[j] for j in buffer_others]), [g / micro_batches for g in grads]

        def body(params, others, states, hyper, batch, rng):
            if random:  # a fresh key per step, and per device: each device drops out its own units
                key, next_key = jax.random.split(jax.random.wrap_key_data(rng))
                key, rng = jax.random.fold_in(key, lax.axis_index(AXIS)), jax.random.key_data(next_key)
            else:
                key = None
            # differentiate each device's own loss: marked as varying over the axis, a replicated
            # parameter's gradient is this device's alone (not implicitly summed by the transpose)
            own = [p if s else lax.pcast(p, AXIS, to="varying") for p, s in zip(params, sharded)]
            with over_axis(AXIS, devices):
                if micro_batches == 1:
                    (loss, buffers), grads = gradient(own, others, batch, key)
                else:
                    (loss, buffers), grads = accumulate(own, others, batch, key)
            # replicated params: the mean of the devices' gradients (one all-reduce for all of them);
            # sharded rows: their lookup's backward already summed over devices, so divide
            replicated = [i for i, s in enumerate(sharded) if not s]
            means = lax.pmean([grads[i] for i in replicated], AXIS)
            for i, g in zip(replicated, means):
                grads[i] = g
            for i, s in enumerate(sharded):
                if s:
                    grads[i] = grads[i] / devices
            if max_norm is not None:
                grads = _clip(grads, sharded, max_norm)
            new_params, new_states = [], []
            for i, cfg in enumerate(configs):
                p, s = _optim.update(cfg, params[i], grads[i], tuple(states[i]), hyper[i])
                new_params.append(p)
                new_states.append(s)
            buffers = [lax.pmean(b, AXIS) if jnp.issubdtype(b.dtype, jnp.floating) else lax.pmax(b, AXIS)
                       for b in buffers]
            return new_params, buffers, new_states, loss.reshape(1), rng
        return body

    # -- one call ------------------------------------------------------------------------------

    def __call__(self, tensors: list[Any]) -> torch.Tensor:
        owner = self.owner
        params, states, rows, steps = self._train_state()
        others = [self._global(get(), split=False) for get in self.others]
        batch = [self._global(tensors[leaf], split=True) for leaf in self.batch_leaves]
        if self.has_random:
            rng = owner.rng(lambda words: self._global(words, split=False))
        else:
            if self._no_rng is None:
                self._no_rng = self._global(np.zeros(2, np.uint32), split=False)
            rng = self._no_rng
        if rows != self._hyper_rows:  # unchanged between most steps: no transfer then
            self._hyper_rows = rows
            self._hyper = self._global(np.asarray(rows, dtype=np.float32).reshape(len(rows), _optim.FIELDS),
                                       split=False)
        hyper = self._hyper
        args = (params, others, states, hyper, batch, rng)
        if self._executable is None:
            self._executable = self.step.compiled(*args)
            owner.stats.compile_seconds += self.step.stats.compile_seconds
        new_params, buffers, new_states, losses, rng = self._executable(*args)
        if self.has_random:
            owner._rng = rng
        self._write_back(new_params, new_states, steps, buffers)
        # a view of the loss where it was computed, as eager torch returns it: reading it on the host
        # is the caller's choice (a GPU step does not wait for it otherwise)
        local = [to_torch(s.data, torch.float32) for s in losses.addressable_shards]
        return local[0].reshape(()) if len(local) == 1 else torch.cat(local).mean()

    def _global(self, value: Any, split: bool) -> jax.Array:
        """This process's `value` (torch, numpy or a global array) as a global array on the mesh:
        the same on every device (`split=False`), or its rows split over this process's devices.
        CPU tensors are wrapped without a copy (XLA only reads its arguments)."""
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            return value
        devices = self._devices
        if not isinstance(value, torch.Tensor):
            value = np.asarray(value)
            value = np.ascontiguousarray(value, dtype=jax.dtypes.canonicalize_dtype(value.dtype))
        if split:
            rows = value.shape[0] // len(devices)
            pieces = [value[i * rows:(i + 1) * rows] for i in range(len(devices))]
            shape = (rows * self._total, *value.shape[1:])
        else:
            pieces, shape = [value] * len(devices), tuple(value.shape)
        shards = [_on_device(piece, device) for piece, device in zip(pieces, devices)]
        return assemble(shape, self._split if split else self._replicated, shards)

    def _train_state(self) -> tuple[list[Any], list[tuple[Any, ...]], list[list[float]], list[float]]:
        """This step's parameters, optimizer state (global arrays), hyperparameter rows and the
        optimizer step counts after it."""
        owner = self.owner
        optimizer, tracked = owner.optimizer, owner._tracked
        groups = optimizer.param_groups
        params, states, rows, steps = [], [], [], []
        for (get, cfg, group_index), sharded in zip(self.trainable, self.sharded):
            p = get()
            state = optimizer.state.get(p, {})
            row, step = _optim.hyper_row(cfg, groups[group_index], state)
            rows.append(row)
            steps.append(step)
            record = tracked.get((id(p), "param"))
            if record is not None and record.fresh(p):
                params.append(record.array)
            else:
                if record is not None:
                    owner.stats.state_reloads += 1
                params.append(self._global(p, split=sharded))
            values = []
            initial = None
            for field in cfg.state:
                current = state.get(field)
                record = tracked.get((id(p), field))
                if record is not None and current is record.view:
                    values.append(record.array)
                elif current is not None:
                    owner.stats.state_reloads += record is not None
                    values.append(self._global(current, split=sharded))
                else:
                    initial = initial or _optim.initial_state(cfg, p)
                    values.append(self._global(initial[len(values)], split=sharded))
            states.append(tuple(values))
        return params, states, rows, steps

    def _write_back(self, new_params: list[jax.Array], new_states: list[tuple[jax.Array, ...]],
                    steps: list[float], buffers: list[jax.Array]) -> None:
        owner = self.owner
        optimizer, tracked = owner.optimizer, owner._tracked
        for (get, cfg, _), sharded, array, state_arrays, step in zip(
                self.trainable, self.sharded, new_params, new_states, steps):
            p = get()
            with torch.no_grad():
                p.data = _view(array, p.dtype, sharded)
            tracked[(id(p), "param")] = _Tracked(array, p)
            if not cfg.state:
                continue  # plain SGD keeps no state; torch leaves optimizer.state empty too
            state = optimizer.state[p]
            for field, value in zip(cfg.state, state_arrays):
                view = _view(value, p.dtype, sharded)
                state[field] = view
                tracked[(id(p), field)] = _Tracked(value, view)
            if cfg.kind == "adam":
                state["step"] = torch.tensor(step, dtype=torch.float32)
        with torch.no_grad():
            for get, value in zip(self.buffer_getters, buffers):
                buffer = get()
                buffer.copy_(to_torch(value.addressable_data(0), buffer.dtype))
        # what torch.optim's step wrapper records, read by LR schedulers' "lr_scheduler.step()
        # before optimizer.step()" warning: the update did run, inside the executable
        optimizer._opt_called = True


def _on_device(piece: Any, device: Any) -> jax.Array:
    if isinstance(piece, torch.Tensor):
        return to_jax(piece, device=device)
    array = import_buffer(piece, device) if device.platform == "cpu" else None
    return array if array is not None else jax.device_put(piece, device)


def _view(array: jax.Array, dtype: torch.dtype, sharded: bool) -> torch.Tensor:
    """This process's part of a global array as a torch tensor (zero-copy for one local device)."""
    shards = array.addressable_shards
    if not sharded or len(shards) == 1:
        return to_torch(shards[0].data, dtype)
    ordered = sorted(shards, key=lambda s: s.index[0].start or 0)
    return torch.cat([to_torch(s.data, dtype) for s in ordered])


def _clip(grads: list[Any], sharded: list[bool], max_norm: float) -> list[Any]:
    """torch.nn.utils.clip_grad_norm_ on the averaged gradients (sharded rows summed over devices)."""
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads]
    replicated = sum((s for s, sh in zip(squares, sharded) if not sh), jnp.float32(0))
    split = sum((s for s, sh in zip(squares, sharded) if sh), jnp.float32(0))
    total = jnp.sqrt(replicated + (lax.psum(split, AXIS) if any(sharded) else 0.0))
    coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
    return [(g * coef).astype(g.dtype) for g in grads]
