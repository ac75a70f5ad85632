"""`tpudist.compile` for JAX functions: an XLA-compiled SPMD step over a mesh of every process's devices.

    mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})
    step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, None, P("data")), donate_argnums=(0, 1))
    for batch in my_local_batches():                       # this process's rows only
        params, opt_state, loss = step(params, opt_state, batch)

Arguments are turned into global `jax.Array`s before the call: an array that already lives on the
mesh's devices (params from `ShardedEmbedding.init`, the outputs of the previous step) is used as
it is; anything else (numpy, Python numbers, arrays on one device) is this process's local part and
is assembled with `jax.make_array_from_process_local_data` under the argument's `PartitionSpec`
(_jax_args.py).
Each distinct signature (tree structure, shapes, dtypes, shardings, static values) is lowered and
compiled once, through JAX's persistent compilation cache; `compile_stats()` counts it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import tpudist._profile as _profile
import tpudist._stacks as _stacks
from tpudist.compile._efficiency import model_flops
from tpudist.compile._jax_args import globalize, is_spec

log = logging.getLogger("tpudist.compile")

_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class CompileStats:
    """Counts of compiled-step work in this process (or of one step, as `step.stats`).

    `compiles`: executables built for a new signature, whether XLA compiled them or they came from
    the persistent cache; `cache_hits`: how many of those the persistent cache served;
    `compile_seconds`: wall time spent tracing, lowering and compiling or loading them; `calls`:
    step calls. A training loop with fixed shapes shows `compiles == 1` however many steps it runs.
    """

    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    calls: int = 0

    def _add(self, other: "CompileStats") -> None:
        self.compiles += other.compiles
        self.cache_hits += other.cache_hits
        self.compile_seconds += other.compile_seconds
        self.calls += other.calls


_stats_lock = threading.Lock()
_totals = CompileStats()
_persistent_hits = 0
_listener_installed = False


def _on_event(event: str, **_: Any) -> None:
    global _persistent_hits
    if event == _CACHE_HIT_EVENT:
        with _stats_lock:
            _persistent_hits += 1


def _install_listener() -> None:
    global _listener_installed
    with _stats_lock:
        if _listener_installed:
            return
        _listener_installed = True
    jax.monitoring.register_event_listener(_on_event)


def compile_stats() -> CompileStats:
    """A snapshot of this process's totals over every `tpudist.compile`d JAX step. Example::

        step(params, batch); step(params, batch)
        assert tpudist.compile_stats().compiles == 1
    """
    with _stats_lock:
        return dataclasses.replace(_totals)


def _canonical_spec(spec: P) -> tuple:
    """P("a") and P("a", None) lay an array out identically; key them the same."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)


def _leaf_key(leaf: jax.Array) -> tuple:
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        where: Any = (sharding.mesh, _canonical_spec(sharding.spec), sharding.memory_kind)
    else:
        where = sharding
    return (leaf.shape, leaf.dtype, bool(getattr(leaf, "weak_type", False)), where)


class CompiledStep:
    """A compiled SPMD step; call it like the function it wraps. See `compile_jax`."""

    def __init__(self, fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any,
                 donate_argnums: Sequence[int], static_argnums: Sequence[int], per_device: bool,
                 name: str):
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.donate_argnums = tuple(donate_argnums)
        self.static_argnums = tuple(static_argnums)
        self.per_device = per_device
        self.name = name
        self.stats = CompileStats()
        self._executables: dict[Any, Any] = {}
        self._flops: dict[int, float | None] = {}  # by id of each kept executable: model_flops of its program
        self._mesh_devices = frozenset(mesh.devices.flat)
        # XLA:CPU with several devices per process and gloo between processes deadlocks when
        # executions of consecutive steps overlap (seen after ~100-200 un-synced 2x2 DLRM steps;
        # one device per process never hung). There the host is the device anyway, so wait for
        # the previous step to finish before starting the next; accelerators stay asynchronous.
        processes = {d.process_index for d in self._mesh_devices}
        local = [d for d in self._mesh_devices if d.process_index == jax.process_index()]
        self._serialize = (len(processes) > 1 and len(local) > 1
                           and all(getattr(d, "platform", "") == "cpu" for d in local))
        self._in_flight: list[Any] = []
        self._stored: Any = None  # see store_lowered

    def __repr__(self) -> str:
        return (f"CompiledStep({self.name}, mesh={dict(self.mesh.shape)}, per_device={self.per_device}, "
                f"signatures={len(self._executables)})")

    # -- compiling -------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        if _profile.active:
            with _profile.span(f"tpudist.step[{self.name}]", call=self.stats.calls + 1):
                return self._call(args)
        return self._call(args)

    def _call(self, args: tuple) -> Any:
        executable, dynamic = self._prepare(args)
        self.stats.calls += 1
        _stacks.entered("compiled step")  # progress for the launcher's --hang-timeout
        with _stats_lock:
            _totals.calls += 1
        if self._serialize:
            jax.block_until_ready([x for x in self._in_flight if not x.is_deleted()])
        out = executable(*dynamic)
        if self._serialize:
            self._in_flight = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        return out

    def compiled(self, *args: Any) -> Any:
        """The XLA executable (`jax.stages.Compiled`) this step runs for these arguments, compiled
        now if it is new; e.g. `step.compiled(params, batch).memory_analysis()` for per-device bytes."""
        return self._prepare(args)[0]

    def flops(self, executable: Any) -> float | None:
        """The matmul and convolution FLOPs one device runs per call of `executable`, one of this
        step's (`compiled`), loops counted per iteration (tpudist.compile._efficiency.model_flops)."""
        return self._flops.get(id(executable))

    def _prepare(self, args: tuple) -> tuple[Any, list[Any]]:
        if self.in_specs is not None and not is_spec(self.in_specs) and len(self.in_specs) != len(args):
            raise ValueError(f"{self.name}: in_specs has {len(self.in_specs)} entries for {len(args)} "
                             "arguments; give one per positional argument (None keeps a global "
                             "array's sharding)")
        for i in self.static_argnums + self.donate_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"{self.name}: argnum {i} is out of range for {len(args)} arguments")
        static_idx = {i % len(args) for i in self.static_argnums}
        statics = tuple((i, args[i]) for i in sorted(static_idx))
        if _profile.active:  # the arguments' crossing to the mesh's devices
            with _profile.span(f"tpudist.step_inputs[{self.name}]"):
                dynamic = self._globalize(args, static_idx)
        else:
            dynamic = self._globalize(args, static_idx)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        try:
            key = (treedef, tuple(_leaf_key(x) for x in leaves), statics)
            hash(key)
        except TypeError as e:
            raise TypeError(f"{self.name}: static arguments must be hashable: {e}") from None
        executable = self._executables.get(key)
        if executable is None:
            executable = self._compile(key, dynamic, statics, len(args))
        return executable, dynamic

    def _globalize(self, args: tuple, static_idx: set[int]) -> list[jax.Array]:
        return [globalize(self.name, self.mesh, self._mesh_devices, self.in_specs, i, a)
                for i, a in enumerate(args) if i not in static_idx]

    def _compile(self, key: Any, dynamic: list[Any], statics: tuple, nargs: int) -> Any:
        with _profile.span(f"tpudist.compile_step[{self.name}]", signature=len(self._executables) + 1):
            return self._compile_now(key, dynamic, statics, nargs)

    def _compile_now(self, key: Any, dynamic: list[Any], statics: tuple, nargs: int) -> Any:
        _install_listener()
        body, donate = self._wrapped(self.fn, dynamic, statics, nargs)
        jitted = jax.jit(body, donate_argnums=donate)
        with _stats_lock:
            hits_before = _persistent_hits
        start = time.perf_counter()
        stored = None if self._stored is None else self._stored.compile(self, jitted, donate, dynamic, statics, nargs)
        if stored is not None:
            executable, flops = stored
        else:
            traced = jitted.trace(*dynamic)
            flops = model_flops(traced.jaxpr, self.mesh.devices.size)
            executable = traced.lower().compile()
        if not self.per_device:
            executable = self._pin_outputs(executable, body, donate, dynamic)
        seconds = time.perf_counter() - start
        self._flops[id(executable)] = flops
        with _stats_lock:
            hit = _persistent_hits > hits_before
            delta = CompileStats(compiles=1, cache_hits=int(hit), compile_seconds=seconds)
            _totals._add(delta)
        self.stats._add(delta)
        self._executables[key] = executable
        shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in jax.tree_util.tree_leaves(dynamic)[:6])
        more = len(jax.tree_util.tree_leaves(dynamic)) - 6
        log.info("tpudist.compile: %s %s in %.2fs (signature %d; args %s%s)", self.name,
                 "loaded from the persistent compilation cache" if hit else "compiled", seconds,
                 len(self._executables), shapes, f", +{more} more" if more > 0 else "")
        return executable

    def store_lowered(self, stored: Any) -> None:
        """Keeps the lowered program between processes (`stored.compile`, the fused torch step's
        step cache: `tpudist.compile._torch.train._stored`)."""
        self._stored = stored

    def _wrapped(self, fn: Callable[..., Any], dynamic: list[Any], statics: tuple,
                 nargs: int) -> tuple[Callable[..., Any], tuple[int, ...]]:
        """`fn` as the step jits it (statics bound, under shard_map or with its outputs laid out),
        and the donated positions among the dynamic arguments."""
        static_idx = [i for i, _ in statics]
        dynamic_idx = [i for i in range(nargs) if i not in static_idx]

        def with_statics(*dyn: Any) -> Any:
            full: list[Any] = [None] * nargs
            for i, value in statics:
                full[i] = value
            for i, value in zip(dynamic_idx, dyn):
                full[i] = value
            return fn(*full)

        body: Callable[..., Any] = with_statics
        if self.per_device:
            in_specs = tuple(jax.tree_util.tree_map(lambda x: x.sharding.spec, d) for d in dynamic)
            out_specs = jax.tree_util.tree_map(lambda s: P() if s is None else s, self.out_specs,
                                               is_leaf=is_spec)
            body = jax.shard_map(with_statics, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
        elif self.out_specs is not None:
            body = self._constrained(with_statics)
        donate = tuple(dynamic_idx.index(i % nargs) for i in self.donate_argnums)
        return body, donate

    def _constrained(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with its outputs laid out by `out_specs` (None leaves: XLA's choice)."""
        def constrain(spec: P | None, subtree: Any) -> Any:
            if spec is None:
                return subtree
            sharding = NamedSharding(self.mesh, spec)
            return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, sharding),
                                          subtree)

        def wrapped(*args: Any) -> Any:
            out = fn(*args)
            if is_spec(self.out_specs):
                return constrain(self.out_specs, out)
            try:
                return jax.tree_util.tree_map(constrain, self.out_specs, out, is_leaf=is_spec)
            except ValueError as e:
                raise ValueError(f"{self.name}: out_specs must be a PartitionSpec or a tree of them "
                                 f"(None: XLA chooses) that is a prefix of the outputs: {e}") from e
        return wrapped

    def _pin_outputs(self, executable: Any, body: Callable[..., Any], donate: tuple[int, ...],
                     dynamic: list[Any]) -> Any:
        """Recompiles when XLA put an output on a device subset (outputs that do not depend on any
        input run on one device): every output must be a global array on the mesh so that the
        next step (and every process) can use it. Such outputs become replicated."""
        shardings = executable.output_shardings
        leaves, treedef = jax.tree_util.tree_flatten(shardings)
        if all(isinstance(s, NamedSharding) and s.device_set == self._mesh_devices for s in leaves):
            return executable
        fixed = [s if isinstance(s, NamedSharding) and s.device_set == self._mesh_devices
                 else NamedSharding(self.mesh, P()) for s in leaves]
        log.debug("%s: outputs on a device subset; recompiling them replicated", self.name)
        pinned = jax.jit(body, donate_argnums=donate, out_shardings=treedef.unflatten(fixed))
        return pinned.lower(*dynamic).compile()


def compile_jax(fn: Callable[..., Any], *, mesh: Any, in_specs: Any = None, out_specs: Any = None,
                donate_argnums: int | Sequence[int] = (), static_argnums: int | Sequence[int] = (),
                per_device: bool = False, name: str | None = None) -> CompiledStep:
    """Compiles `fn` into an SPMD step over `mesh` (every device of every process).

    Each process calls the step with the same arguments in the same order. Per argument:

    - a `jax.Array` already on the mesh's devices (params, optimizer state, a previous step's
      outputs, `ShardedEmbedding.init`) is global and is used as it is (resharded to its
      `in_specs` entry if one is given and differs);
    - anything else (numpy arrays, Python numbers, arrays on one device) is this process's LOCAL
      part, assembled into a global array laid out by the argument's `in_specs` entry (default
      replicated, `P()`). For `P("data")` each process passes its own rows and the global batch is
      the concatenation over the processes along "data"; dims whose axes stay inside a process
      take the same values on every process. `tpudist.mesh.process_slice` says which rows are
      whose.

    `in_specs` is None (all default), a `PartitionSpec` for every argument, or a tuple with one
    entry per positional argument, each a PartitionSpec, None, or a tree of them (a prefix of the
    argument's structure). `out_specs` (a PartitionSpec or a tree of them that is a prefix of the
    outputs) fixes the outputs' layout; None, as a whole or at a leaf, lets XLA choose. Outputs
    are always global arrays on the mesh, ready to feed the next step; one that depends on no
    input (XLA would leave it on one device) comes back replicated. `donate_argnums` lets XLA
    reuse those arguments' buffers for the outputs (pass params and optimizer state, then drop
    the old references); `static_argnums` are hashable Python values baked into the program.

    By default `fn` sees global arrays (`jax.jit` semantics; XLA's partitioner inserts the
    collectives). With `per_device=True` it runs under `jax.shard_map`: it sees each device's
    block (laid out by each argument's sharding), may use in-graph collectives by axis name
    (`jax.lax.psum(x, "data")`, `tpudist.all_reduce(x, axis="data")`), and `out_specs` is
    required. Example::

        def train_step(params, opt_state, dense, labels):
            loss, grads = jax.value_and_grad(loss_fn)(params, dense, labels)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, None, P("data"), P("data")),
                               donate_argnums=(0, 1))
        params, opt_state, loss = step(params, opt_state, local_dense, local_labels)

    Each new signature compiles once (counted by `compile_stats()`, logged on logger
    "tpudist.compile"); repeating a signature reuses the executable, and `step.compiled(*args)`
    returns it (e.g. for `.memory_analysis()`). Calls are asynchronous like `jax.jit`'s, except on
    CPU jobs with several devices per process, where a step waits for the previous one to finish
    (overlapping multi-device CPU executions deadlock in XLA's gloo collectives).
    """
    from jax.sharding import Mesh
    if not callable(fn):
        raise TypeError(f"compile expects a function, got {type(fn).__name__}")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if set(donate) & set(static):
        raise ValueError(f"arguments {sorted(set(donate) & set(static))} are both donated and static")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (tpudist.mesh.make_mesh builds one), "
                        f"got {type(mesh).__name__}")
    if per_device and out_specs is None:
        raise ValueError("per_device=True needs out_specs: how each output's per-device blocks form "
                         "the global result (P() for values every device holds the same)")
    if in_specs is not None and not is_spec(in_specs) and not isinstance(in_specs, (tuple, list)):
        raise TypeError(f"in_specs must be None, a PartitionSpec, or a tuple with one entry per "
                        f"argument, got {type(in_specs).__name__}")
    inner = getattr(fn, "func", fn)  # functools.partial: name the function it wraps
    label = name or getattr(inner, "__name__", None) or type(fn).__name__
    return CompiledStep(fn, mesh, in_specs, out_specs, donate, static, per_device, label)
