"""`tpudist.parallelize`: a torch model laid out on a mesh once, honoured by every path.

    mesh = tpudist.mesh.make_mesh({"model": 4})
    model = tpudist.parallelize(model, mesh, "llama")      # each device holds 1/4 of every large weight
    logits = tpudist.compile(model)(ids)                     # the module path, over the mesh
    model.forward = torch.compile(model.forward, backend="tpudist")   # dynamo: the same arrays
    model.generate(ids, cache_implementation="static")       # Hugging Face generation, sharded
    step = tpudist.compile_train_step(model, None, opt)     # the fused step takes the mesh and layout

A `Layout` holds one global array per parameter and buffer, laid out by the same plans the sharded
fused step takes (`Sharding`: FSDP, the tensor-parallel presets, module-path rules; buffers and
parameters no rule names are replicated). A compiled call of a laid-out model (`Program`, through
`tpudist.compile` or the dynamo backend) finds each of its parameters here by the tensor's identity
and runs as one program over the whole mesh (XLA's SPMD partitioner inserts the collectives); its
other inputs enter replicated and its outputs come back whole, on every process.

Arrays are made from torch's tensors and follow them: a tensor torch changed (its version counter
moved: `load_state_dict`, an in-place write) is laid out again at the next call. A model built on
the meta device is initialised straight into its shards (as the fused step does, see
`train/_meta.py`); its torch tensors are then placeholders whose reads go through a door: any
torch read of one gathers the values first (on one process; over several processes that is a
collective, so a read raises there and names `tpudist.layout(model).sync()`, to call on every one).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from tpudist.compile._torch import _stale
from tpudist.compile._torch._custom_ops import SHARDED_ATTR
from tpudist.compile._torch._meta import materialize, on_meta
from tpudist.compile._torch._placement import AXIS, Placement, SpmdPlacement, put_laid_out, relaid
from tpudist.compile._torch._sharding import Sharding, resolve

__all__ = ["Layout", "parallelize", "layout", "layout_of_tensor"]

_ATTR = "_tpudist_layout"
# id(tensor) -> (weakref to the tensor, weakref to its Layout): how a compiled call finds the layout
_BY_TENSOR: dict[int, tuple[Any, Any]] = {}


class _Entry:
    __slots__ = ("ref", "version", "array", "spec", "name")

    def __init__(self, tensor: torch.Tensor, array: jax.Array, spec: P, name: str):
        self.ref, self.version, self.array, self.spec, self.name = weakref.ref(tensor), _state(tensor), array, spec, name


def _state(tensor: torch.Tensor) -> tuple[int, int]:
    """What changes when torch writes a tensor: its version counter, or its storage when swapped."""
    return tensor._version, tensor.data_ptr()


class Layout:
    """A model's parameters and buffers as global arrays over `mesh` (see the module docstring).

    mesh: the jax Mesh. sharding: the `Sharding` it was laid out by (None: everything replicated).
    """

    def __init__(self, model: torch.nn.Module, mesh: Any, sharding: Any = None):
        self.mesh = mesh
        self.sharding = None if sharding is None else Sharding.of(sharding)
        self.replicated = NamedSharding(mesh, P())
        me = jax.process_index()
        self.devices = [d for d in mesh.devices.flat if d.process_index == me]
        if not self.devices:
            raise ValueError(f"rank {me}: the mesh {dict(mesh.shape)} holds none of this process's devices; build it "
                             "with tpudist.mesh.make_mesh over every process's devices")
        self.specs: dict[int, P] = resolve(self.sharding, model, mesh) if self.sharding is not None else {}
        self._entries: dict[int, _Entry] = {}
        self._model = weakref.ref(model)
        # what compiled calls of the model keep on the devices between calls (a static KV cache)
        self.residents: weakref.WeakSet[Any] = weakref.WeakSet()
        preloaded: dict[int, jax.Array] = {}
        if on_meta(model):
            preloaded = materialize(model, lambda t, p: self.put(t, self.specs.get(id(p), P())))
        self._classes = _stale.classes_for()
        self.optimizer = None  # (the stale door's Owner protocol: no optimizer state here)
        hollow = []
        for name, p in itertools.chain(model.named_parameters(remove_duplicate=True),
                                       model.named_buffers(remove_duplicate=True)):
            if id(p) in self._entries:
                continue
            spec = self.specs.get(id(p), P())
            array = preloaded.get(id(p))
            if array is None:
                array = self.put(p.detach(), spec)
            else:
                hollow.append(p)
            self._add(p, array, spec, name)
        self._hollow = _stale.mark(hollow, self._classes, self) if hollow else []

    # -- placing -------------------------------------------------------------------------------

    def put(self, tensor: torch.Tensor, spec: P = P()) -> jax.Array:
        """`tensor`'s values (the same on every process) as a global array laid out by `spec`."""
        return put_laid_out(tensor, NamedSharding(self.mesh, spec), self.devices, copy=True)

    def _add(self, tensor: torch.Tensor, array: jax.Array, spec: P, name: str) -> None:
        self._entries[id(tensor)] = _Entry(tensor, array, spec, name)
        _BY_TENSOR[id(tensor)] = (weakref.ref(tensor), weakref.ref(self))
        weakref.finalize(tensor, _forget, id(tensor))

    def array(self, tensor: torch.Tensor) -> jax.Array | None:
        """The global array of a laid-out `tensor` (laid out again first if torch changed it since);
        None for a tensor this layout does not hold."""
        entry = self._entries.get(id(tensor))
        if entry is None or entry.ref() is not tensor:
            return None
        if _state(tensor) != entry.version and not self._is_hollow(tensor):
            entry.array, entry.version = self.put(tensor.detach(), entry.spec), _state(tensor)
        return entry.array

    def _is_hollow(self, tensor: torch.Tensor) -> bool:
        return any(t is tensor for t in self._hollow)

    # -- reading -------------------------------------------------------------------------------

    def shardings(self) -> dict[str, P]:
        """Parameter and buffer name -> its `PartitionSpec` (P() replicated)."""
        return {e.name: e.spec for e in self._entries.values() if e.ref() is not None}

    def memory(self) -> dict[str, int]:
        """Bytes one device holds (the most over this process's devices): `parameters`, `buffers`,
        and `cache`: what compiled calls keep on the devices between calls (a static KV cache);
        and the same unsharded, whole: `parameters_total`, `buffers_total`, `cache_total`."""
        model = self._model()
        params = {id(p) for p in model.parameters()} if model is not None else set()
        kinds = ("parameters", "buffers", "cache")
        arrays = [("parameters" if key in params else "buffers", entry.array)
                  for key, entry in self._entries.items() if entry.ref() is not None]
        arrays += [("cache", array) for resident in list(self.residents) for array in resident.arrays()]
        out = dict.fromkeys([*kinds, *(f"{k}_total" for k in kinds)], 0)
        per_device: dict[Any, dict[str, int]] = {}
        for kind, array in arrays:
            out[f"{kind}_total"] += array.nbytes
            for shard in array.addressable_shards:
                slot = per_device.setdefault(shard.device, dict.fromkeys(kinds, 0))
                slot[kind] += shard.data.nbytes
        for slot in per_device.values():
            for kind in kinds:
                out[kind] = max(out[kind], slot[kind])
        return out

    # -- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict[str, dict[str, jax.Array]]:
        """{"params": {name: array}, "buffers": {name: array}}: the global arrays as laid out, for
        `tpudist.checkpoint.save` (each process writes its own shards) and as `restore`'s `like`."""
        model = self._model()
        params = {id(p) for p in model.parameters()} if model is not None else set()
        tree: dict[str, dict[str, jax.Array]] = {"params": {}, "buffers": {}}
        for key, entry in self._entries.items():
            tensor = entry.ref()
            if tensor is not None:
                tree["params" if key in params else "buffers"][entry.name] = self.array(tensor)
        return tree

    def load_state(self, tree: dict[str, dict[str, Any]]) -> None:
        """Makes `tree` (as `state()` gives it: `tpudist.checkpoint.restore(d, like=layout.state())[1]`,
        each process reading only its own shards) the model's values, laid out as this layout
        says. Torch's tensors become placeholders whose reads go through the door (as after a
        meta-device init): nothing is gathered to the host."""
        given = {**tree.get("params", {}), **tree.get("buffers", {})}
        names = {e.name for e in self._entries.values() if e.ref() is not None}
        missing, unknown = sorted(names - set(given)), sorted(set(given) - names)
        if missing or unknown:
            raise ValueError(f"load_state: the state does not match the model's layout: missing {missing[:4]}, "
                             f"unknown {unknown[:4]}; restore with like=tpudist.layout(model).state()")
        hollow = []
        for entry in self._entries.values():
            tensor = entry.ref()
            if tensor is None:
                continue
            array = given[entry.name]
            if tuple(array.shape) != tuple(tensor.shape):
                raise ValueError(f"load_state: {entry.name} has shape {tuple(array.shape)} in the state and "
                                 f"{tuple(tensor.shape)} in the model")
            entry.array = relaid(self.mesh, entry.spec)(array)
            if not tensor.is_floating_point():  # (small: position ids, counters) torch gets the values
                tensor.data = torch.from_numpy(np.array(relaid(self.mesh)(array).addressable_data(0)))
            elif not self._is_hollow(tensor):
                tensor.data = torch.full((), float("nan"), dtype=tensor.dtype).expand(tensor.shape)
                hollow.append(tensor)
            entry.version = _state(tensor)
        self._hollow += _stale.mark(hollow, self._classes, self)

    # -- the door for placeholders (a model built on the meta device) ------------------------------

    def holds_placeholders(self) -> bool:
        """Whether some parameter's values live on the devices only (a meta-device model)."""
        return bool(self._hollow)

    def hand_over(self) -> dict[int, jax.Array]:
        """The arrays of the parameters that live on the devices only, by `id`, for a fused step
        over the same mesh and layout, which from now on holds their newest values (its own
        door answers torch's reads)."""
        hollow, self._hollow = self._hollow, []
        _stale.unmark(hollow, self._classes)
        return {id(t): self._entries[id(t)].array for t in hollow}

    def stale_read(self) -> None:
        if jax.process_count() > 1:
            raise RuntimeError("a torch read of a parameter of a model initialised on the devices "
                               "(tpudist.parallelize on a meta-device model) gathers it from every process: call "
                               "tpudist.layout(model).sync() on every process first, at the same point")
        self.sync()

    def sync(self) -> None:
        """Gives torch real tensors for the parameters initialised on the devices (a model built on
        the meta device): each is gathered whole and copied to the host. A collective over the
        processes: every process calls it at the same point."""
        hollow, self._hollow = self._hollow, []
        _stale.unmark(hollow, self._classes)
        gather = relaid(self.mesh)
        for tensor in hollow:
            entry = self._entries[id(tensor)]
            whole = np.asarray(gather(entry.array).addressable_data(0))
            tensor.data = torch.from_numpy(whole.copy()).to(tensor.dtype)  # the same object, real values
            entry.version = _state(tensor)

    @contextlib.contextmanager
    def unmarked(self) -> Iterator[None]:
        """The placeholders as plain tensors for a while, without a gather: for a capture, which
        traces shapes and never reads values."""
        marked = [t for t in self._hollow if isinstance(t, _stale.Stale)]  # (nested: the outer one's are plain)
        _stale.unmark(marked, self._classes)
        try:
            yield
        finally:
            if self._hollow and marked:
                _stale.mark(marked, self._classes, self)


@contextlib.contextmanager
def capturing(tensors: Iterable[Any]) -> Iterator[None]:
    """Every layout holding one of `tensors` with its placeholders plain (see `Layout.unmarked`)."""
    layouts = {id(found): found for found in map(layout_of_tensor_any, tensors) if found is not None
               and found.holds_placeholders()}
    with contextlib.ExitStack() as stack:
        for found in layouts.values():
            stack.enter_context(found.unmarked())
        yield


def layout_of_tensor_any(value: Any) -> Layout | None:
    return layout_of_tensor(value) if isinstance(value, torch.Tensor) else None


def _forget(key: int) -> None:
    found = _BY_TENSOR.get(key)
    if found is not None and found[0]() is None:
        del _BY_TENSOR[key]


def layout_of_tensor(tensor: torch.Tensor) -> Layout | None:
    """The live layout holding `tensor`, if any (one dict lookup)."""
    found = _BY_TENSOR.get(id(tensor))
    if found is None or found[0]() is not tensor:
        return None
    return found[1]()


def layout(model: torch.nn.Module) -> Layout | None:
    """The `Layout` `tpudist.parallelize` gave `model` (None for a model not laid out)."""
    return model.__dict__.get(_ATTR)


def parallelize(model: torch.nn.Module, mesh: Any = None, sharding: Any = None) -> torch.nn.Module:
    """Lays `model` out on `mesh` and returns it (the same object): every parameter and buffer
    becomes a global array over the mesh, split as `sharding` says and replicated otherwise. Then
    `tpudist.compile(model)`, `torch.compile(model, backend="tpudist")` (and Hugging Face
    `generate` through either) run over the whole mesh, and `tpudist.compile_train_step(model, ...)`
    and `fit` take this mesh and layout by default.

    mesh: a jax Mesh (`tpudist.mesh.make_mesh`), default every device of every process on one
        "model" axis when `sharding` is a tensor-parallel plan, one "fsdp" axis for "fsdp", else
        one "data" axis (the model replicated).
    sharding: as `compile_train_step`'s: "fsdp", a preset ("llama", "gpt2"), a plan
        ({"*.q_proj": "colwise", "lm_head.weight": PartitionSpec("model", None)}), or
        `tpudist.Sharding(fsdp=..., tp=...)`; None replicates everything.

    A model built under `torch.device("meta")` is initialised module by module straight into its
    shards (seed torch the same on every process). Every process must call this, and every compiled
    call of the model, together with the same inputs: the mesh's processes run one program.

        mesh = tpudist.mesh.make_mesh({"model": 4})
        model = tpudist.parallelize(LlamaForCausalLM(config).eval(), mesh, "llama")
        tokens = tpudist.compile(model).generate(ids, max_new_tokens=32, cache_implementation="static")
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpudist.parallelize lays out a torch.nn.Module; got {type(model).__name__}")
    if layout(model) is not None:
        raise ValueError(f"{type(model).__name__} is laid out already (tpudist.layout(model)); build a new model "
                         "to lay it out another way")
    if mesh is None:
        from tpudist.mesh import make_mesh
        full = None if sharding is None else Sharding.of(sharding)
        axis = ("model" if full is not None and full.rules else
                full.fsdp_axis if full is not None and full.fsdp_axis else "data")
        mesh = make_mesh({axis: -1})
    model.__dict__[_ATTR] = Layout(model, mesh, sharding)
    return model


def step_placement(model: torch.nn.Module, mesh: Any, sharding: Any) -> tuple[Any, Any, dict, dict]:
    """A fused step's `Sharding` (None: data-parallel), its placement over `mesh` (default: the
    layout's mesh for a model `parallelize` laid out, else every device on one "data" axis, or on
    one "fsdp" axis for FSDP), each parameter's layout, and the parameters a meta-device model was
    initialised into (see _meta), by tpudist.parallelize or here. A laid-out model's `sharding`
    defaults to its layout's."""
    laid = layout(model)
    if laid is not None:
        mesh = laid.mesh if mesh is None else mesh
        sharding = laid.sharding if sharding is None else sharding
    sharding = None if sharding is None else Sharding.of(sharding)
    return (sharding, *_step_placement(model, mesh, sharding, laid))


def _step_placement(model: torch.nn.Module, mesh: Any, sharding: Any, laid: Layout | None) -> tuple[Any, dict, dict]:
    if laid is not None and laid.holds_placeholders():
        if sharding is not None and mesh is laid.mesh and sharding == laid.sharding:
            placement = SpmdPlacement(mesh, laid.specs)
            return placement, laid.specs, laid.hand_over()
        laid.sync()  # laid out another way: torch gets the values, and the step lays them out its own way
    if mesh is None:
        from tpudist.mesh import make_mesh
        if sharding is not None and sharding.rules:
            raise ValueError("a tensor-parallel plan needs a mesh with its axes: pass mesh=tpudist.mesh.make_mesh("
                             "{'fsdp': -1, 'model': M}) (or {'data': -1, 'model': M})")
        mesh = make_mesh({sharding.fsdp_axis if sharding and sharding.fsdp_axis else AXIS: -1})
    if sharding is not None:
        if any(getattr(p, SHARDED_ATTR, False) for p in model.parameters()):
            raise NotImplementedError("the sharded fused step does not take tpudist.nn.ShardedEmbedding layers "
                                      "yet (they split their rows by themselves): train it without sharding=, "
                                      "or lay the embedding out with the plan (an nn.Embedding, 'rowwise')")
        specs = resolve(sharding, model, mesh)
        placement = SpmdPlacement(mesh, specs)
        preloaded = {}
        if on_meta(model):  # each module initialised straight into its shards (see _meta)
            preloaded = materialize(model, lambda t, p: placement.put(t, specs.get(id(p), P()), copy=True))
        return placement, specs, preloaded
    if on_meta(model):
        raise ValueError(f"{type(model).__name__} is on the meta device: initialising it into shards needs "
                         "sharding= (e.g. 'fsdp'); for data parallelism build it on the CPU")
    if tuple(mesh.axis_names) != (AXIS,):
        raise ValueError(f"the fused step over a mesh with axes {tuple(mesh.axis_names)} needs sharding= (how to "
                         "lay the parameters out: 'fsdp', a tensor-parallel plan, tpudist.Sharding(...)); "
                         f"without it the step is data-parallel over a 1-D {AXIS!r} mesh")
    return Placement(mesh), {}, {}
