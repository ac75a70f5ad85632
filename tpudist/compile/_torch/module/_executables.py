"""The XLA executables of one captured graph: plain forward, forward-with-VJP per set of
differentiated inputs, and backward, each compiled once and then called directly.

`_program.Program` feeds them JAX arrays made from torch's tensors; `_autograd` calls
forward-with-VJP and backward from inside torch's autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch._convert import Where, to_host, to_jax, to_torch
from tpudist.compile._torch._pack import Packing
from tpudist.compile._torch._placement import InputStaging
from tpudist.compile._torch.lowering._captured import Captured
from tpudist.compile._torch.lowering._lower import lower
from tpudist.compile._torch.module._laid_out import MeshRun
from tpudist.compile._torch.module._spmd import ProcessMesh


class Executables:
    """The executables of one captured graph and the gradient plumbing between them.

    `observe` sees every output of a forward executable call, residuals included (the program
    decides from the first staged call whether its input staging is safe).
    """

    def __init__(self, captured: Captured, observe: Callable[[Any], None]):
        self.captured = captured
        self._observe = observe
        run, unrolled = lower(captured), lower(captured, scan=False)
        random = captured.has_random
        # each call's seed (drawn from torch's generator) becomes the graph's PRNG key in-graph
        self._run = lambda arrays, seed: run(arrays, jax.random.key(seed) if random else None)
        # calls without gradients (inference) run every layer on its own: see lower's `scan`
        self._infer = lambda arrays, seed: unrolled(arrays, jax.random.key(seed) if random else None)
        outputs = captured.outputs
        # floating user outputs go through autograd; everything else (ints, buffer updates) does not
        self.floats = tuple(i for i, o in enumerate(outputs) if o.kind == "user" and o.dtype is not None
                            and (o.dtype.is_floating_point or o.dtype.is_complex))
        self.rest = tuple(i for i in range(len(outputs)) if i not in self.floats)
        self.float_output_dtypes = [outputs[i].dtype for i in self.floats]
        # fresh callables per program: jit caches per underlying function, and count() must count
        # this program's executables only
        self._spmd = ProcessMesh(self._run) if captured.collective else None
        self._compiled_forward: dict[tuple[int, ...], Any] = {}
        self._compiled_backward: dict[Any, Any] = {}
        self._packings: dict[tuple[int, ...], Packing] = {}
        self._reached: dict[tuple, tuple[bool, ...]] = {}
        self.laid_out = MeshRun(captured, self._infer)  # for a model laid out by tpudist.parallelize
        self._donating: dict[tuple[int, ...], Any] = {}  # plain forwards that donate written inputs
        # fresh cotangents from torch's autograd: staged like the inputs (see InputStaging), per
        # device; absent until the first backward there decides, False where they are imported afresh
        self._cotangent_staging: dict[Any, InputStaging | bool] = {}
        if self._spmd is None:
            self._forward = jax.jit(lambda arrays, seed: self._infer(arrays, seed))
            self._forward_with_vjp = jax.jit(self._vjp_forward, static_argnums=0)
            self._backward = jax.jit(lambda vjp, cotangents: _packed(_apply_vjp(vjp, cotangents)))
            self._scale = jax.jit(lambda grads, c: [(g * c).astype(g.dtype) for g in grads])
        else:
            # one SPMD program over the processes (see _spmd); backward recomputes the forward
            self._forward = jax.jit(lambda arrays, seed: self._spmd.run(arrays, seed))
            self._forward_with_vjp = self._forward
            self._backward = jax.jit(self._spmd_backward, static_argnums=0)

    def _vjp_forward(self, diff: tuple[int, ...], arrays: list[jax.Array], seed: jax.Array):
        def differentiable(diff_arrays):
            full = list(arrays)
            for position, value in zip(diff, diff_arrays):
                full[position] = value
            outs = self._run(full, seed)
            return [outs[i] for i in self.floats], [outs[i] for i in self.rest]

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
            return [outs[i] for i in self.floats]

        _, vjp = jax.vjp(differentiable, [arrays[p] for p in diff])
        return _apply_vjp(vjp, cotangents)

    def forward(self, arrays: list[jax.Array], seed: Any, where: Where, keep: frozenset[int] = frozenset(),
                donate: tuple[int, ...] = ()) -> list[Any]:
        """Every output of the graph, with no gradient plumbing (nothing to differentiate), where
        torch can view it (`where.host`: copied to the host), except the outputs at `keep`, which
        stay on the device. The arrays at input positions `donate` are the executable's to reuse
        (a written input's resident array: updated in place, not copied)."""
        if self._spmd is None:
            result = self._forward(arrays, seed) if not donate else self._donating_forward(donate)(arrays, seed)
            self._observe(result)
        else:
            spmd = self._spmd
            outs = self._forward([spmd.to_global(a) for a in arrays], spmd.to_global(np.asarray(seed)))
            result = [spmd.to_local(o) for o in outs]
        return host_values(result, keep) if where.host else result

    def _donating_forward(self, donate: tuple[int, ...]) -> Callable[[list[jax.Array], Any], Any]:
        call = self._donating.get(donate)
        if call is None:
            def merged(arrays: list[Any], written: list[jax.Array], seed: Any) -> Any:
                full = list(arrays)
                for position, array in zip(donate, written):
                    full[position] = array
                return self._infer(full, seed)
            jitted = jax.jit(merged, donate_argnums=1)
            gone = frozenset(donate)
            call = self._donating[donate] = lambda arrays, seed: jitted(
                [None if i in gone else a for i, a in enumerate(arrays)], [arrays[i] for i in donate], seed)
            call.jitted = jitted
        return call

    def forward_with_vjp(self, diff: tuple[int, ...], arrays: list[jax.Array], seed: Any, where: Where):
        """(floating outputs, other outputs, VJP closure): one XLA executable per `diff` and device,
        called directly once compiled (jit's dispatch with a static argument costs tens of us a
        call). The outputs are where torch can view them; the VJP's residuals stay on the device."""
        if self._spmd is None:
            key = (diff, where.device)
            compiled = self._compiled_forward.get(key)
            if compiled is None:
                compiled = self._compiled_forward[key] = self._forward_with_vjp.lower(diff, arrays, seed).compile()
            primal, rest, vjp = compiled(arrays, seed)
            self._observe((primal, rest, vjp))
        else:
            spmd = self._spmd
            arrays, seed = [spmd.to_global(a) for a in arrays], spmd.to_global(np.asarray(seed))
            outs = [spmd.to_local(o) for o in self._forward(arrays, seed)]

            def vjp(cotangents: list[jax.Array]) -> list[jax.Array]:
                grads = self._backward(diff, arrays, seed, [spmd.to_global(c) for c in cotangents])
                return [spmd.to_local(g) for g in grads]
            primal, rest = [outs[i] for i in self.floats], [outs[i] for i in self.rest]
        if where.host:
            crossed = host_values([*primal, *rest])
            primal, rest = crossed[:len(primal)], crossed[len(primal):]
        return primal, rest, vjp

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
                 dtypes: list[torch.dtype], where: Where) -> list[torch.Tensor]:
        """Gradients of the differentiated inputs as torch tensors of `dtypes`: one XLA executable
        on the forward's device (`where`, which holds the VJP's residuals), none for a scalar
        output whose cotangent is 1 (`loss.backward()`)."""
        device = where.device
        if isinstance(vjp, _Scaled):
            (cotangent,) = cotangents
            if cotangent.item() == 1:  # one number read (a device sync only where the loss is on one)
                grads = vjp.grads
            else:
                grads = self._scale(vjp.grads, to_jax(cotangent, device=device))
            return packing.unpack(host_values(grads) if where.host else grads, dtypes)
        if self._spmd is not None:
            grads = vjp([to_jax(g, device=device) for g in cotangents])
            return [to_torch(g, dtype) for g, dtype in zip(host_values(grads) if where.host else grads, dtypes)]
        staging = self._cotangent_staging.get(device)
        if staging is None:
            staging = self._cotangent_staging[device] = InputStaging.build(
                cotangents, list(range(len(cotangents))), device) or False
        staged = staging.acquire(cotangents) if staging and staging.fits(cotangents) else None
        grads = None
        try:
            arrays = ([staged[i] for i in range(len(cotangents))] if staged
                      else [to_jax(g, device=device) for g in cotangents])
            key = (jax.tree_util.tree_structure((vjp, arrays)), device)
            compiled = self._compiled_backward.get(key)
            if compiled is None:
                compiled = self._compiled_backward[key] = self._backward.lower(vjp, arrays).compile()
            grads = compiled(vjp, arrays)
            if staged and not staging.checked:
                staging.check(grads)
            return packing.unpack(host_values(grads) if where.host else grads, dtypes)  # waits for the executable
        finally:
            if staged is not None and not staging.release(grads[0] if grads else None):
                self._cotangent_staging[device] = False

    def count(self) -> int:
        """How many XLA executables have been compiled so far (0 where JAX cannot say)."""
        jitted = {id(f): f for f in (self._forward, self._forward_with_vjp, self._backward)}.values()
        jitted = [*jitted, *(call.jitted for call in self._donating.values())]
        return (sum(getattr(f, "_cache_size", lambda: 0)() for f in jitted) + len(self._compiled_forward)
                + len(self._compiled_backward) + self.laid_out.compiles)


@jax.tree_util.register_dataclass
@dataclass
class _Scaled:
    """The gradients of a scalar output for a cotangent of 1, standing in for its VJP closure."""

    grads: list[jax.Array]


def host_values(values: list[Any], keep: frozenset[int] = frozenset()) -> list[Any]:
    """`values` with each array copied to the host in one transfer (`to_host`); others, and those at
    `keep`, as they are."""
    arrays = [i for i, v in enumerate(values) if isinstance(v, jax.Array) and i not in keep]
    out = list(values)
    for i, array in zip(arrays, to_host([values[i] for i in arrays])):
        out[i] = array
    return out


def _apply_vjp(vjp: Any, cotangents: list[jax.Array]) -> list[jax.Array]:
    (grads,) = vjp(_torch_convention(cotangents))
    return _torch_convention(grads)


def _torch_convention(values: list[jax.Array]) -> list[jax.Array]:
    """Complex cotangents between torch and JAX: torch's gradient of a real loss L at z is
    dL/dRe z + i dL/dIm z, JAX's its conjugate; the same map converts either way."""
    return [jnp.conj(v) if jnp.iscomplexobj(v) else v for v in values]


def _packed(grads: list[jax.Array]) -> list[jax.Array]:
    return Packing.of(grads).pack(grads)
