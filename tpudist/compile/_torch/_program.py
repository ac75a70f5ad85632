"""A Program: one cache entry of a compiled module, for one input signature and train/eval mode.

It owns the captured graph, the lowered JAX function and its executables (plain forward,
forward-with-VJP per set of differentiated inputs, backward), and runs one call end to end:
torch tensors in, XLA, torch tensors out, buffers updated in place as eager torch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch._autograd import XlaCall, XlaFunction
from tpudist.compile._torch._capture import Captured
from tpudist.compile._torch._convert import ViewCache, to_jax, to_torch
from tpudist.compile._torch._lower import lower
from tpudist.compile._torch._pack import Packing
from tpudist.compile._torch._placement import InputStaging
from tpudist.compile._torch._spmd import ProcessMesh


class Program:
    """The executables for one captured graph of `module`."""

    def __init__(self, module: torch.nn.Module, captured: Captured):
        self.captured = captured
        run = lower(captured)
        random = captured.has_random
        # each call's seed (drawn from torch's generator) becomes the graph's PRNG key in-graph
        self._run = lambda arrays, seed: run(arrays, jax.random.key(seed) if random else None)
        self._slots = [slot for slot in captured.inputs if slot.kind != "literal"]
        self._resolve = [_resolver(module, slot, captured) for slot in self._slots]
        self._buffer_position = {slot.name: i for i, slot in enumerate(self._slots) if slot.kind == "buffer"}
        # parameters and buffers the graph only reads cross once, as views (see ViewCache)
        self._long_lived = [slot.kind in ("param", "buffer", "constant") and not slot.mutated for slot in self._slots]
        # inputs that are differentiated whenever the call's tensor there requires grad
        self._differentiable = tuple(i for i, slot in enumerate(self._slots)
                                     if slot.used and slot.kind in ("param", "input"))
        self._views = ViewCache()
        outputs = captured.outputs
        # floating user outputs go through autograd; everything else (ints, buffer updates) does not
        self._float = tuple(i for i, o in enumerate(outputs) if o.kind == "user" and o.dtype is not None
                            and (o.dtype.is_floating_point or o.dtype.is_complex))
        self._rest = tuple(i for i in range(len(outputs)) if i not in self._float)
        self.float_output_dtypes = [outputs[i].dtype for i in self._float]
        self._writes_back = any(o.kind in ("buffer", "input") for o in outputs)  # else all outputs are the user's
        self._mutated_inputs = [i for i, slot in enumerate(self._slots) if slot.kind == "input" and slot.mutated]
        # fresh callables per program: jit caches per underlying function, and executables()
        # must count this program's executables only
        self._spmd = ProcessMesh(self._run) if captured.collective else None
        self._compiled_forward: dict[tuple[int, ...], Any] = {}
        self._compiled_backward: dict[Any, Any] = {}
        self._packings: dict[tuple[int, ...], Packing] = {}
        self._reached: dict[tuple, tuple[bool, ...]] = {}
        # small CPU inputs: copied into reused device buffers (see InputStaging); None until the
        # first call decides, False where they are imported afresh
        self._staging: InputStaging | None | bool = None
        self._cotangent_staging: InputStaging | None | bool = None
        if self._spmd is None:
            self._forward = jax.jit(lambda arrays, seed: self._run(arrays, seed))
            self._forward_with_vjp = jax.jit(self._vjp_forward, static_argnums=0)
            self._backward = jax.jit(lambda vjp, cotangents: _packed(_apply_vjp(vjp, cotangents)))
            self._scale = jax.jit(lambda grads, c: [(g * c).astype(g.dtype) for g in grads])
        else:
            # one SPMD program over the processes (see _spmd); backward recomputes the forward
            self._forward = jax.jit(lambda arrays, seed: self._spmd.run(arrays, seed))
            self._forward_with_vjp = self._forward
            self._backward = jax.jit(self._spmd_backward, static_argnums=0)

    # -- executables ---------------------------------------------------------------------------

    def _vjp_forward(self, diff: tuple[int, ...], arrays: list[jax.Array], seed: jax.Array):
        def differentiable(diff_arrays):
            full = list(arrays)
            for position, value in zip(diff, diff_arrays):
                full[position] = value
            outs = self._run(full, seed)
            return [outs[i] for i in self._float], [outs[i] for i in self._rest]

        primal, vjp, rest = jax.vjp(differentiable, [arrays[p] for p in diff], has_aux=True)
        if len(primal) == 1 and primal[0].shape == () and jnp.issubdtype(primal[0].dtype, jnp.floating):
            # A scalar output (a loss): its VJP is linear in the one cotangent, so the gradients
            # for a cotangent of 1 come out of this same executable, forward and backward fused
            # as jax.value_and_grad is; backward only scales them (see `backward`).
            grads = _torch_convention(vjp([jnp.ones_like(primal[0])])[0])
            return primal, rest, _Scaled(Packing.of(grads).pack(grads))
        return primal, rest, vjp

    def _spmd_backward(self, diff: tuple[int, ...], arrays: list[jax.Array], seed: jax.Array,
                       cotangents: list[jax.Array]) -> list[jax.Array]:
        def differentiable(diff_arrays):
            full = list(arrays)
            for position, value in zip(diff, diff_arrays):
                full[position] = value
            outs = self._spmd.run(full, seed)
            return [outs[i] for i in self._float]

        _, vjp = jax.vjp(differentiable, [arrays[p] for p in diff])
        return _apply_vjp(vjp, cotangents)

    def forward_with_vjp(self, diff: tuple[int, ...], arrays: list[jax.Array], seed: Any):
        """(floating outputs, other outputs, VJP closure): one XLA executable per `diff`, called
        directly once compiled (jit's dispatch with a static argument costs tens of us a call)."""
        if self._spmd is None:
            compiled = self._compiled_forward.get(diff)
            if compiled is None:
                compiled = self._compiled_forward[diff] = self._forward_with_vjp.lower(diff, arrays, seed).compile()
            result = compiled(arrays, seed)
            self._check_staging(result)
            return result
        spmd = self._spmd
        arrays, seed = [spmd.to_global(a) for a in arrays], spmd.to_global(np.asarray(seed))
        outs = [spmd.to_local(o) for o in self._forward(arrays, seed)]

        def vjp(cotangents: list[jax.Array]) -> list[jax.Array]:
            grads = self._backward(diff, arrays, seed, [spmd.to_global(c) for c in cotangents])
            return [spmd.to_local(g) for g in grads]
        return [outs[i] for i in self._float], [outs[i] for i in self._rest], vjp

    def reached(self, diff: tuple[int, ...], used: tuple[int, ...]) -> tuple[bool, ...]:
        """Per differentiated input: whether the gradient of the floating outputs `used` (positions
        among them) reaches it."""
        key = (diff, used)
        found = self._reached.get(key)
        if found is None:
            reach = frozenset().union(*(self.captured.reaches[i] for i in used))
            found = self._reached[key] = tuple(p in reach for p in diff)
        return found

    def packing(self, diff: tuple[int, ...], arrays: list[jax.Array]) -> Packing | None:
        """How the gradients of the `diff` inputs cross to torch (None: one by one, SPMD)."""
        if self._spmd is not None:
            return None
        packing = self._packings.get(diff)
        if packing is None:
            packing = self._packings[diff] = Packing.of([arrays[p] for p in diff])
        return packing

    def backward(self, vjp: Any, cotangents: list[torch.Tensor], packing: Packing | None,
                 dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Gradients of the differentiated inputs as torch tensors of `dtypes`: one XLA executable,
        none for a scalar output whose cotangent is 1 (`loss.backward()`)."""
        if isinstance(vjp, _Scaled):
            (cotangent,) = cotangents
            if cotangent.item() == 1:  # one number read (a device sync only where the loss is on one)
                return packing.unpack(vjp.grads, dtypes)
            return packing.unpack(self._scale(vjp.grads, to_jax(cotangent)), dtypes)
        if self._spmd is not None:
            return [to_torch(g, dtype) for g, dtype in zip(vjp([to_jax(g) for g in cotangents]), dtypes)]
        # the cotangents are fresh tensors from torch's autograd each call: staged like the inputs
        staging = self._cotangent_staging
        if staging is None:
            staging = self._cotangent_staging = InputStaging.build(cotangents, list(range(len(cotangents)))) or False
        staged = staging.acquire(cotangents) if staging and staging.fits(cotangents) else None
        grads = None
        try:
            arrays = [staged[i] for i in range(len(cotangents))] if staged else [to_jax(g) for g in cotangents]
            structure = jax.tree_util.tree_structure((vjp, arrays))
            compiled = self._compiled_backward.get(structure)
            if compiled is None:
                compiled = self._compiled_backward[structure] = self._backward.lower(vjp, arrays).compile()
            grads = compiled(vjp, arrays)
            if staged and not staging.checked:
                staging.check(grads)
            return packing.unpack(grads, dtypes)  # waits for the executable
        finally:
            if staged is not None and not staging.release(grads[0] if grads else None):
                self._cotangent_staging = False

    def _plain_forward(self, arrays: list[jax.Array], seed: Any) -> list[jax.Array]:
        if self._spmd is None:
            result = self._forward(arrays, seed)
            self._check_staging(result)
            return result
        spmd = self._spmd
        outs = self._forward([spmd.to_global(a) for a in arrays], spmd.to_global(np.asarray(seed)))
        return [spmd.to_local(o) for o in outs]

    def executables(self) -> int:
        """How many XLA executables this program has compiled so far (0 where JAX cannot say)."""
        jitted = {id(f): f for f in (self._forward, self._forward_with_vjp, self._backward)}.values()
        return (sum(getattr(f, "_cache_size", lambda: 0)() for f in jitted) + len(self._compiled_forward)
                + len(self._compiled_backward))

    # -- one call ------------------------------------------------------------------------------

    def __call__(self, leaves: list[Any]) -> Any:
        tensors = [resolve(leaves) for resolve in self._resolve]
        diff = tuple(i for i in self._differentiable if tensors[i].requires_grad
                     and (tensors[i].is_floating_point() or tensors[i].is_complex())) if torch.is_grad_enabled() else ()
        for i in self._mutated_inputs:
            if tensors[i].requires_grad and torch.is_grad_enabled():
                raise RuntimeError(f"torch -> XLA: the compiled forward modifies its input {self._slots[i].name} "
                                   "in place while it requires grad; tpudist writes the new value back outside "
                                   "autograd. Modify a copy inside forward (x = x.clone()), or detach the input")
        staging = self._staging
        if staging is None:
            staging = self._staging = self._input_staging(tensors) or False
        staged = staging.acquire(tensors) if staging else None
        first = None
        try:
            arrays = [staged[i] if staged is not None and i in staged
                      else self._views.get(i, t) if self._long_lived[i] else to_jax(t, copy=slot.mutated)
                      for i, (t, slot) in enumerate(zip(tensors, self._slots))]
            seed = _seed() if self.captured.has_random else np.uint32(0)
            outputs: list[Any] = [None] * len(self.captured.outputs)
            if diff and self._float:
                call = XlaCall(self, arrays, diff, seed)
                floats = XlaFunction.apply(call, *(tensors[i] for i in diff))
                rest, first = call.rest, call.first
            else:
                # converting an output to torch waits for it; by then XLA is done reading the inputs
                results = self._plain_forward(arrays, seed)
                floats = [to_torch(results[i], self.captured.outputs[i].dtype) for i in self._float]
                rest, first = [results[i] for i in self._rest], results[0] if results else None
        finally:
            if staged is not None and not staging.release(first):
                self._staging = False  # unsafe to reuse (see InputStaging.release): import afresh from now on
        for i, value in zip(self._float, floats):
            outputs[i] = value
        for i, value in zip(self._rest, rest):
            slot = self.captured.outputs[i]
            outputs[i] = to_torch(value, slot.dtype) if slot.dtype is not None else value
        return self._finish(outputs, leaves, tensors)

    def _input_staging(self, tensors: list[torch.Tensor]) -> InputStaging | None:
        if self.captured.collective or not self.captured.outputs:
            return None
        slots = [i for i, slot in enumerate(self._slots)
                 if slot.kind == "input" and not slot.mutated and not self._long_lived[i]]
        return InputStaging.build(tensors, slots)

    def _check_staging(self, result: Any) -> None:
        """Sees every output of an executable call, residuals included: those of the first staged
        call decide whether staging is safe for this program."""
        staging = self._staging
        if staging and not staging.checked:
            staging.check(jax.tree_util.tree_leaves(result))

    def _finish(self, outputs: list[Any], leaves: list[Any], tensors: list[torch.Tensor]) -> Any:
        if not self._writes_back:
            return self.captured.template.rebuild(outputs)
        user = []
        with torch.no_grad():
            for value, slot in zip(outputs, self.captured.outputs):
                if slot.kind == "buffer":
                    # in place, as eager BatchNorm updates its running statistics
                    tensors[self._buffer_position[slot.target]].copy_(value)
                elif slot.kind == "input":
                    leaves[slot.target].copy_(value)
                else:
                    user.append(value)
        return self.captured.template.rebuild(user)


@jax.tree_util.register_dataclass
@dataclass
class _Scaled:
    """The gradients of a scalar output for a cotangent of 1, standing in for its VJP closure."""

    grads: list[jax.Array]


def _apply_vjp(vjp: Any, cotangents: list[jax.Array]) -> list[jax.Array]:
    (grads,) = vjp(_torch_convention(cotangents))
    return _torch_convention(grads)


def _torch_convention(values: list[jax.Array]) -> list[jax.Array]:
    """Complex cotangents between torch and JAX: torch's gradient of a real loss L at z is
    dL/dRe z + i dL/dIm z, JAX's its conjugate; the same map converts either way."""
    return [jnp.conj(v) if jnp.iscomplexobj(v) else v for v in values]


def _packed(grads: list[jax.Array]) -> list[jax.Array]:
    return Packing.of(grads).pack(grads)


def _seed() -> np.uint32:
    # drawn from torch's default generator, so torch.manual_seed makes compiled dropout reproducible
    return np.uint32(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def _resolver(module: torch.nn.Module, slot: Any, captured: Captured):
    """A function reading the slot's current tensor; parameters and buffers are looked up on each
    call (one dict lookup), so reassigning `module.weight` between calls is seen."""
    if slot.kind in ("param", "buffer"):
        path, _, attr = slot.name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        table = owner._parameters if slot.kind == "param" else owner._buffers
        return lambda leaves: table[attr]
    if slot.kind == "constant":
        value = captured.constants[slot.name]
        return lambda leaves: value
    return lambda leaves: leaves[slot.leaf]
