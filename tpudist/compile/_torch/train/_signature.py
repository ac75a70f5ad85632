"""One compiled signature of the fused step: its executable, and how each call feeds it.

A `Signature` is built once per batch signature, train/eval mode and autocast setting: it
captures the objective on an example batch, classifies its inputs (`_plan`), lowers it into the
per-device body (`_body`) and compiles that under `shard_map`. A call hands the executable the
state the mirror holds, the batch and the step's inputs, launches it without waiting, and returns
its `StepOutputs`; the train step (`_fused.TrainStep`) applies them. Between its own steps the
signature keeps the buffers its graph writes back (it is the mirror's `BufferHolder`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch
from jax.sharding import PartitionSpec as P

import tpudist._profile as _profile
from tpudist.compile._torch._pack import Packing
from tpudist.compile._torch._placement import AXIS, Placement, Staging
from tpudist.compile._torch.lowering._capture import capture
from tpudist.compile._torch.lowering._lower import lower
from tpudist.compile._torch.lowering._parallel import CONTEXT_AXIS, EXPERT_AXIS, STAGE_AXIS, MeshLayout, laid_out
from tpudist.compile._torch.train._body import StepOutputs, make_body, make_global_body
from tpudist.compile._torch.train._plan import Layout, Objective, plan
from tpudist.compile._torch.train._pool import POOL_MAX_BYTES, StatePool, flatten_state, stacked_cut, stacked_pack
from tpudist.compile._torch.train._stages import Stacking, layer_groups, stage_groups
from tpudist.compile._torch.train._stored import StoredStep, stand_in
from tpudist.compile._torch.train._state import Mirror

RUN_AHEAD = 8  # staged batches in flight: how many steps the host may run ahead of the device (see Staging)


class Signature:
    """The compiled step for one batch signature, train/eval mode and autocast setting.

    `capture_seconds` is what its capture took; `on_compile(seconds)` is told each time its
    executable is compiled (the first call, and again for a pool of other shapes or dtypes)."""

    def __init__(self, objective: Objective, example: Any, *, layout: Layout, mirror: Mirror,
                 placement: Placement, accumulate: int, max_grad_norm: float | None, name: str,
                 on_compile: Callable[[float], None]):
        from tpudist.compile._jax_step import compile_jax
        # an "expert" mesh axis: transformers' experts modules as one op, their experts split over it
        experts = placement.spmd and EXPERT_AXIS in placement.mesh.axis_names
        # the step cache (lowering._capture_cache): the one-process and data-parallel steps
        captured = capture(objective, (example,), {}, where=" (or train with tpudist.eager_step)",
                           torch_autograd=False, experts=experts, cache=not placement.spmd)
        self.capture_seconds = captured.seconds
        self.guard = captured.guard  # data-dependent values it specialised on (see lowering._observed)
        self.mirror, self.placement, self._on_compile = mirror, placement, on_compile
        self.plan = plan(captured, objective, layout)
        self.random = captured.has_random
        devices = placement.mesh.devices.size
        stored: StoredStep | None = None
        if placement.spmd:  # sharded: one global-view program, laid out by the parameters' specs
            if self.guard is not None:
                raise NotImplementedError(
                    f"{type(objective.model).__name__} computes shapes or branches from its inputs (see "
                    "tpudist.explain); the sharded fused step does not specialise on them yet: train it "
                    "data-parallel (no sharding=) or make those values static")
            param_specs = [placement.param_split(e) for e in layout.entries]
            # context parallelism: layers unscanned (XLA's partitioner keeps a scan's saved activations whole)
            scan = CONTEXT_AXIS not in placement.mesh.axis_names
            stacking = _stacking(captured, self.plan, layout, placement, param_specs, objective.model)
            if stacking is not None:  # pipeline parallelism: the pipelined layers' state held stacked
                mirror.pool.stack(stacking)
                param_specs = stacking.specs
            run = lower(captured, scan=scan, microbatches=accumulate if stacking is not None else None)
            body = make_global_body(self.plan, layout, run, specs=param_specs, batch_spec=placement.batch_spec,
                                    batch_shards=placement.batch_shards, mesh=placement.mesh, accumulate=accumulate,
                                    random=self.random, max_norm=max_grad_norm, stacking=stacking)
            body = _laid_out(body, MeshLayout(placement.mesh, placement.batch_axes, _sequence(example)))
            split = placement.batch_spec
            loss_spec, per_device = P(), False
        else:
            collective = _averages(devices, layout)

            # one device: a run of layers' weights cut from the pool as one stack each (`_pool.stacked_cut`)
            groups = layer_groups(captured, self.plan, layout) if mirror.pool.pooled else []

            def build(run: Callable[..., Any]) -> Callable[..., StepOutputs]:
                made = make_body(self.plan, layout, run, devices=devices, accumulate=accumulate,
                                 random=self.random, max_norm=max_grad_norm, collective=collective,
                                 together_bytes=POOL_MAX_BYTES if mirror.pool.pooled else 0,
                                 rows={i: (group[0], row) for group in groups for row, i in enumerate(group)})
                return _pooled(made, mirror.pool, groups) if mirror.pool.pooled else made

            body = build(_lowered(captured))
            if captured.key is not None:
                stored = StoredStep(captured.key, build(stand_in(captured)))
            if mirror.pool.pooled:  # one device: the parameters and optimizer state as a pool
                param_specs = P()
            else:
                param_specs = [P(AXIS) if e.sharded else P() for e in layout.entries]
            split = P(AXIS) if collective else P()  # the batch and the signal: per device, or the one device's
            loss_spec, per_device = P(AXIS), True
        stacked = mirror.pool.stacking.rows if mirror.pool.stacking is not None else {}
        state_specs = P() if mirror.pool.pooled else \
            [() if stacked.get(i, (i,))[0] != i else tuple(spec for _ in e.config.state)
             for i, (spec, e) in enumerate(zip(param_specs, layout.entries))]
        in_specs = (param_specs, P(), P(), state_specs, P(), P(), split, P(), split)
        out_specs = StepOutputs(param_specs, P(), state_specs, P(), loss_spec, P(), P())
        self.step = compile_jax(body, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs,
                                per_device=per_device, donate_argnums=(0, 2, 3, 4), name=f"train step ({name})")
        self.stored = stored
        if stored is not None:
            self.step.store_lowered(stored)
        self._serialize = self.step._serialize
        self._span_name = f"tpudist.torch_step[{name}]"
        self._executable: jax.stages.Compiled | None = None
        self.flops: float | None = None  # one device's matmul and convolution FLOPs per call (model_flops)
        self._packing: Packing | None = None  # the mirror's pool layout the executable was compiled for
        self._in_flight: jax.Array | None = None
        self.fixed: list[jax.Array] = []
        self.updated: list[jax.Array] = []
        self.updated_keys = [key for key, _ in self.plan.updated]
        self._generation = -1
        self._batches: tuple[list[jax.Array] | None, list[jax.Array] | None] = (None, None)
        shards = placement.batch_shards if placement.spmd else 1  # the example is the global micro-batch
        self._staging = _staging(placement, example, self.plan.batch_leaves, placement.local_count * accumulate, shards)
        mirror.register(self.plan.fixed, self.plan.updated)

    @property
    def executable(self) -> jax.stages.Compiled | None:
        """The XLA executable the last call ran (None before the first call)."""
        return self._executable

    def __call__(self, leaves: list[Any], on_device: bool, hyper: jax.Array, rng: jax.Array | None,
                 signal: jax.Array | None, call: int) -> StepOutputs:
        """Launches one step on the batch's `leaves` (device arrays if `on_device`) with the
        hyperparameter table, the random key (None: the graph draws nothing) and the flag (None:
        the step takes none); `call` numbers its profile span. Does not wait for the step."""
        mirror, plan = self.mirror, self.plan
        if mirror.holder is not self:  # another signature (or torch) last wrote the buffers
            mirror.flush_holder()
        if self._generation != mirror.generation:
            self.fixed = [mirror.named[k] for k, _ in plan.fixed]
            self.updated = [mirror.named[k] for k, _ in plan.updated]
            self._generation = mirror.generation
        staged = None
        if on_device:
            batch = [leaves[i] for i in plan.batch_leaves]
        elif self._staging is not None:  # the signature fixes the dtypes the buffers were made for
            batch, staged = self._staging.put([leaves[i] for i in plan.batch_leaves])
        else:
            put = self.placement.put
            batch = [put(leaves[i], split=True, copy=True) for i in plan.batch_leaves]
        params, states = mirror.pool.step_arrays()
        args = (params, self.fixed, self.updated, states, mirror.counts, hyper, batch, rng, signal)
        if self._executable is None or self._packing is not mirror.pool.packing:
            self._packing = mirror.pool.packing  # (a pool of other shapes or dtypes: compiled again)
            self._executable = self.step.compiled(*args)
            self.flops = self.step.flops(self._executable)
            self._on_compile(self.step.stats.compile_seconds)
        if self._serialize and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)  # see CompiledStep: multi-device CPU steps must not overlap
        if _profile.active:
            with _profile.span(self._span_name, call=call):
                out: StepOutputs = self._executable(*args)
        else:
            out = self._executable(*args)
        self.updated = out.updated
        self._in_flight = out.loss
        if staged is not None:
            self._staging.used(staged, out.loss)
        else:
            # imported batch buffers are torch's: released here two steps on, when XLA is done with
            # them, rather than by XLA's thread as the step ends (it would wait for this thread's GIL)
            self._batches = (batch, self._batches[0])
        return out


def _lowered(captured: Any) -> Callable[..., Any]:
    """`lower(captured)`, lowered when first called: a step cache hit never traces the graph."""
    run: list[Callable[..., Any]] = []

    def lowered(tensors: Any, key: Any) -> Any:
        if not run:
            run.append(lower(captured))
        return run[0](tensors, key)

    return lowered


def _staging(placement: Placement, example: Any, batch_leaves: list[int], rows: int,
             shards: int = 1) -> Staging | None:
    """Reused device buffers the batch tensors are copied into (small batch tensors on a CPU mesh,
    see Staging), or None where the batch crosses as it is: this process's batch is `rows` times
    one batch shard's share of the example."""
    leaves = torch.utils._pytree.tree_leaves(example)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    examples = [tensors[i] for i in batch_leaves] if len(tensors) == len(leaves) else []
    if not examples or not all(Staging.fits(placement, t) for t in examples):
        return None
    full = [t.new_zeros((t.shape[0] // shards * rows, *t.shape[1:])) for t in examples]
    try:
        return Staging(placement, full, sets=RUN_AHEAD)
    except RuntimeError:  # this platform copies host memory on import: no reuse possible
        return None


def _pooled(body: Callable[..., StepOutputs], state: StatePool, groups: list[list[int]]) -> Callable[..., StepOutputs]:
    """`body` taking and returning the parameters and optimizer state as the pool (see `_pool`),
    cut into arrays as the step starts (`groups`' as one stack each, `stacked_cut`) and packed
    again as it ends, in the pool's layout when the step is traced."""
    def pooled(pool, fixed, updated, _states, *rest):
        packing = state.packing
        params, states = stacked_cut(packing, pool, state.layout, groups)
        out = body(params, fixed, updated, states, *rest)
        # each array back in the dtype its place in the pool has, so the pool keeps its layout
        return out._replace(params=stacked_pack(packing, state.layout, out.params, out.states, groups), states=[])

    return pooled


def _stacking(captured: Any, plan: Any, layout: Layout, placement: Placement, specs: list[P],
              model: torch.nn.Module) -> Stacking | None:
    """On a mesh with a "stage" axis (pipeline parallelism): the runs of parameters the step holds
    stacked (`_stages`); None elsewhere. ValueError where the step cannot pipeline the model."""
    mesh = placement.mesh
    stages = dict(mesh.shape).get(STAGE_AXIS, 1)
    if stages == 1:
        return None
    others = [a for a in (CONTEXT_AXIS, EXPERT_AXIS) if dict(mesh.shape).get(a, 1) > 1]
    if others:
        raise ValueError(f"pipeline parallelism (mesh axis {STAGE_AXIS!r}) does not combine with mesh axis "
                         f"{others[0]!r} yet; use one of them")
    if plan.updated:
        raise ValueError(f"pipeline parallelism: the model writes buffers in training ({plan.updated[0].key}, e.g. "
                         "BatchNorm statistics), which the micro-batches would update one after another; use a "
                         "model without them, or no 'stage' axis")
    groups = stage_groups(captured, plan, layout, stages, {id(p): n for n, p in model.named_parameters()})
    if not groups:
        raise ValueError("pipeline parallelism: the layers the stages would split hold no trained parameters")
    return Stacking(groups, mesh, specs)


def _sequence(example: Any) -> int | None:
    """The batch's sequence length: dim 1 of its first tensor of 2 or more dims (context parallelism)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(example) if isinstance(t, torch.Tensor) and t.ndim >= 2]
    return int(leaves[0].shape[1]) if leaves else None


def _laid_out(body: Callable[..., StepOutputs], layout: MeshLayout) -> Callable[..., StepOutputs]:
    """`body` traced with its mesh known to the lowerings that split work over its axes (experts
    over "expert", attention's sequence over "context": `lowering/_parallel.py`)."""
    def traced(*args):
        with laid_out(layout):
            return body(*args)
    return traced


def _averages(devices: int, layout: Layout) -> bool:
    """Whether the step averages its gradients over the devices in an all-reduce.

    Not on one device with nothing sharded (see make_body), except where a trained parameter has
    3 or more dims (convolution kernels): XLA:CPU's convolutions give their kernel gradients in
    its own layout, and without the all-reduce in between it fuses the transpose into torch's
    layout into the optimizer update as a strided read; measured 5% slower on ResNet-18 than
    the all-reduce's separate, tiled transpose."""
    if devices > 1 or any(e.sharded for e in layout.entries):
        return True
    return any(e.param.ndim >= 3 for e in layout.entries)
