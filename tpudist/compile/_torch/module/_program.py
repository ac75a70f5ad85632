"""A Program: one cache entry of a compiled module, for one input signature and train/eval mode.

It owns the captured graph and its executables (`_executables`), and runs one call end to end:
torch tensors in (staged into reused device buffers where they are small), XLA, torch tensors
out, buffers updated in place as eager torch does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from tpudist.compile._torch._convert import ViewCache, Where, to_jax, to_torch, viewable, where
from tpudist.compile._torch._placement import InputStaging
from tpudist.compile._torch.lowering._captured import Captured, resolver
from tpudist.compile._torch.module._autograd import XlaCall, XlaFunction
from tpudist.compile._torch.module._executables import Executables, host_values
from tpudist.compile._torch.module._laid_out import whole
from tpudist.compile._torch.module._resident import TWINS, Resident, scatter_outputs, write_scatter, written_array
from tpudist.compile._torch._layout import Layout, layout_of_tensor


class Program:
    """One captured graph of `module` and its executables, called with torch's tensors."""

    def __init__(self, module: torch.nn.Module, captured: Captured, long_lived: frozenset[int] = frozenset()):
        self.captured = captured
        # the indices and values of scatter write-backs, as outputs (before the graph is lowered)
        self._scatters = scatter_outputs(captured)
        # fresh executables per program, so that executables() counts this program's only
        self._executables = Executables(captured, self._check_staging)
        self._slots = [slot for slot in captured.inputs if slot.kind != "literal"]
        self._resolve = [resolver(module, slot, captured) for slot in self._slots]
        self._buffer_position = {slot.name: i for i, slot in enumerate(self._slots) if slot.kind == "buffer"}
        leaf_position = {slot.leaf: i for i, slot in enumerate(self._slots) if slot.kind == "input"}
        # each write-back output's input position; their new arrays stay on the device (see _resident)
        self._written = {j: self._buffer_position[o.target] if o.kind == "buffer" else leaf_position[o.target]
                         for j, o in enumerate(captured.outputs) if o.kind in ("buffer", "input")}
        self._keep = frozenset(self._written)
        self._resident = Resident()
        self._layout: Layout | None | bool = None  # the layout of the model's tensors (False: none); at the first call
        # parameters and buffers the graph only reads cross once, as views (see ViewCache)
        # (and the inputs at `long_lived`: what dynamo passes from the module's parameters and buffers)
        self._long_lived = [not slot.mutated and (slot.kind in ("param", "buffer", "constant")
                                                  or slot.kind == "input" and slot.leaf in long_lived)
                            for slot in self._slots]
        # inputs that are differentiated whenever the call's tensor there requires grad
        self._differentiable = tuple(i for i, slot in enumerate(self._slots)
                                     if slot.used and slot.kind in ("param", "input"))
        self._views = ViewCache()
        self._long = [i for i, long in enumerate(self._long_lived) if long]
        self._short = [i for i, long in enumerate(self._long_lived) if not long]
        self._writes_back = any(o.kind in ("buffer", "input") for o in captured.outputs)  # else all outputs are the user's
        self._mutated_inputs = [i for i, slot in enumerate(self._slots) if slot.kind == "input" and slot.mutated]
        # small CPU inputs: copied into reused device buffers (see InputStaging), per device; absent
        # until the first call there decides, False where they are imported afresh
        self._stagings: dict[Any, InputStaging | bool] = {}
        self._staging: InputStaging | bool = False  # the running call's
        self._cuda: torch.device | None | bool = None  # the CUDA device of the module's tensors (False: CPU)

    def executables(self) -> int:
        """How many XLA executables this program has compiled so far (0 where JAX cannot say)."""
        return self._executables.count()

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
        layout = self._layout
        if layout is None:
            layout = self._layout = self._find_layout(tensors) or False
            if layout:
                layout.residents.add(self._resident)
        if layout:
            return self._call_laid_out(layout, tensors, leaves, diff)
        place = self._where(tensors)
        device = place.device
        staging = self._stagings.get(device)
        if staging is None:
            staging = self._stagings[device] = self._input_staging(tensors, device) or False
        self._staging = staging
        staged = staging.acquire(tensors) if staging else None
        executables, first = self._executables, None
        try:
            arrays: list[Any] = [None] * len(tensors)
            if self._long:  # parameters and buffers: the arrays made before, checked all at once
                longs = self._views.get_all(self._long, [tensors[i] for i in self._long], device)
                for i, array in zip(self._long, longs):
                    arrays[i] = array
            donate = []  # resident written inputs: the executable updates them in place
            for i in self._short:
                slot = self._slots[i]
                kept = written_array(self._resident, i, tensors[i], device, place.host) if slot.mutated else None
                if kept is not None:
                    donate.append(i)
                arrays[i] = (kept if kept is not None else staged[i] if staged is not None and i in staged
                             else to_jax(tensors[i], copy=slot.mutated, device=device))
            seed = _seed() if self.captured.has_random else np.uint32(0)
            outputs: list[Any] = [None] * len(self.captured.outputs)
            keep, on_device = frozenset(), None
            if diff and executables.floats:
                call = XlaCall(executables, arrays, diff, seed, place)
                floats = XlaFunction.apply(call, *(tensors[i] for i in diff))
                rest, first = call.rest, call.first
            else:
                # converting an output to torch waits for it; by then XLA is done reading the inputs
                keep = self._keep
                on_device = executables.forward(arrays, seed, place._replace(host=False), keep, tuple(donate))
                results = host_values(on_device, keep) if place.host else on_device
                floats = [to_torch(results[i], self.captured.outputs[i].dtype) for i in executables.floats]
                rest = [results[i] for i in executables.rest]
                # what staging waits on before reusing its buffers: an output no later call donates
                first = next((r for i, r in enumerate(results) if i not in keep and isinstance(r, jax.Array)), None)
        finally:
            if staged is not None and not staging.release(first):
                self._stagings[device] = False  # unsafe to reuse (see InputStaging.release): import afresh from now on
        for i, value in zip(executables.floats, floats):
            outputs[i] = value
        for i, value in zip(executables.rest, rest):
            slot = self.captured.outputs[i]
            outputs[i] = value if i in keep or slot.dtype is None else to_torch(value, slot.dtype)
        if place.host and on_device is not None:  # what crossed to the host: its device arrays (see Twins)
            TWINS.replace(id(self), outputs, on_device, self.captured.outputs, device)
        return self._finish(outputs, leaves, tensors, place)

    def _find_layout(self, tensors: list[torch.Tensor]) -> Layout | None:
        """The layout (tpudist.parallelize) of the module's parameters and buffers, if any."""
        for slot, tensor, long in zip(self._slots, tensors, self._long_lived):
            if slot.kind in ("param", "buffer") or long:
                found = layout_of_tensor(tensor)
                if found is not None:
                    return found
        return None

    def _call_laid_out(self, layout: Layout, tensors: list[torch.Tensor], leaves: list[Any],
                       diff: tuple[int, ...]) -> Any:
        """One call of a laid-out model: one program over the layout's mesh; the parameters and
        buffers are the layout's arrays, the other inputs enter replicated (written ones stay
        resident, laid out as what is written into them), the outputs come back whole."""
        if diff:
            names = ", ".join(self._slots[i].name for i in diff[:3])
            raise NotImplementedError(
                f"torch -> XLA: a compiled call of a model laid out by tpudist.parallelize runs without gradients "
                f"({names} require grad); call it under torch.no_grad() or torch.inference_mode() for inference, "
                "and train it with tpudist.compile_train_step(model, ...) or tpudist.fit, which take its mesh and layout")
        executables = self._executables
        arrays, donate = [], []
        for i, (slot, tensor) in enumerate(zip(self._slots, tensors)):
            array = layout.array(tensor)
            if array is None and slot.mutated:  # kept from the last call, or a fresh copy: the executable's to update
                array = self._resident.get(i, tensor, layout)
                if array is None:
                    array = layout.put(tensor.detach(), executables.laid_out.resident_spec(i))
                donate.append(i)
            if array is None:
                array = layout.put(tensor.detach())
            arrays.append(array)
        seed = _seed() if self.captured.has_random else np.uint32(0)
        results = executables.laid_out.forward(arrays, seed, layout, self._written, self._scatters, tuple(donate))
        outputs: list[Any] = []
        for i, (value, slot) in enumerate(zip(results, self.captured.outputs)):
            outputs.append(value if i in self._keep or slot.dtype is None else to_torch(value, slot.dtype))
        return self._finish(outputs, leaves, tensors, layout)

    def _where(self, tensors: list[torch.Tensor]) -> Where:
        """Where this call computes: on the GPU of a module whose tensors are CUDA tensors (fixed by
        the first call: a signature's input devices are part of its cache key), else on JAX's
        default device as it is at this call (`_convert.compute_device`)."""
        cuda = self._cuda
        if cuda is None:
            cuda = self._cuda = next((t.device for t in tensors if t.device.type == "cuda"), False)
        return where(cuda or None)

    def _input_staging(self, tensors: list[torch.Tensor], device: Any) -> InputStaging | None:
        if self.captured.collective or not self.captured.outputs:
            return None
        slots = [i for i, slot in enumerate(self._slots)
                 if slot.kind == "input" and not slot.mutated and not self._long_lived[i]]
        return InputStaging.build(tensors, slots, device)

    def _check_staging(self, result: Any) -> None:
        """Sees every output of an executable call, residuals included: those of the first staged
        call decide whether staging is safe for this program."""
        staging = self._staging
        if staging and not staging.checked:
            staging.check(jax.tree_util.tree_leaves(result))

    def _finish(self, outputs: list[Any], leaves: list[Any], tensors: list[torch.Tensor], place: Any) -> Any:
        if not self._writes_back:
            return self.captured.template.rebuild(outputs)
        user = []
        # the kept arrays torch gets whole, crossed to the host together (one round trip, not one each)
        whole_at = [j for j, (value, slot) in enumerate(zip(outputs, self.captured.outputs))
                    if slot.kind in ("buffer", "input") and isinstance(value, jax.Array) and j not in self._scatters]
        wholes = dict(zip(whole_at, _wholes([outputs[j] for j in whole_at], place)))
        with torch.no_grad():
            for j, (value, slot) in enumerate(zip(outputs, self.captured.outputs)):
                if slot.kind in ("buffer", "input"):
                    # in place, as eager BatchNorm updates its running statistics and a KV cache its tokens
                    position = self._written[j]
                    tensor = tensors[position]
                    if isinstance(value, jax.Array):  # kept on the device: torch gets what changed
                        scatter = self._scatters.get(j)
                        if scatter is not None:
                            write_scatter(tensor, scatter, outputs)
                        else:
                            tensor.copy_(to_torch(wholes[j], slot.dtype))
                        self._resident.keep(position, tensor, place.device if isinstance(place, Where) else place,
                                            value)
                    else:
                        tensor.copy_(value)
                        self._resident.drop(position)
                elif slot.kind == "user":
                    user.append(value)
        return self.captured.template.rebuild(user)


def _wholes(arrays: list[jax.Array], place: Where | Layout) -> list[jax.Array]:
    """Kept arrays' whole values where torch can view them."""
    if isinstance(place, Where):
        return host_values(arrays) if place.host else arrays
    return [whole(array, place) for array in arrays]


def _seed() -> np.uint32:
    # drawn from torch's default generator, so torch.manual_seed makes compiled dropout reproducible
    return np.uint32(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


# -- the graph inside another program (serve/_decode: a decode loop on the device) ----------------

def slot_tensors(program: Program, leaves: list[Any]) -> list[torch.Tensor]:
    """The tensor of each of `program`'s input positions for a call with the flat inputs `leaves`."""
    return [resolve(leaves) for resolve in program._resolve]


def loop_arrays(program: Program, leaves: list[Any], device: Any, written: list[int],
                fed: frozenset[int] = frozenset()) -> tuple[list[Any], list[jax.Array]]:
    """The input arrays of a call of `program` with `leaves` on `device` (or over the program's
    layout): the read-only ones as a call makes them (views of torch's tensors where it can see the
    device; the layout's arrays), None at the positions `fed` (the caller's loop feeds them), and
    the inputs at `written` separately, None at their positions: the arrays the program keeps for
    them on the devices (handed over: the caller's loop donates them, so torch's tensors are what
    the caller must not read again), or copies of torch's tensors."""
    tensors = slot_tensors(program, leaves)
    layout = program._layout
    gone = set(written) | fed
    if layout:
        arrays = [None if i in gone else layout.array(t) for i, t in enumerate(tensors)]
        arrays = [a if a is not None or i in gone else layout.put(tensors[i].detach()) for i, a in enumerate(arrays)]
    else:
        arrays = [None] * len(tensors)
        if program._long:
            longs = program._views.get_all(program._long, [tensors[i] for i in program._long], device)
            for i, array in zip(program._long, longs):
                arrays[i] = array
        for i in program._short:
            if i not in gone:
                arrays[i] = to_jax(tensors[i], device=device)
    carried = []
    for i in written:
        # (the prefill's cache: an earlier call's output, still on a device torch cannot view)
        kept = written_array(program._resident, i, tensors[i], layout or device, not layout and not viewable(device))
        program._resident.drop(i)
        if kept is None:
            kept = (layout.put(tensors[i].detach(), program._executables.laid_out.resident_spec(i)) if layout
                    else to_jax(tensors[i], copy=True, device=device))
        carried.append(kept)
    return arrays, carried


def loop_graph(program: Program) -> tuple[Any, dict[int, int], Layout | None]:
    """`program`'s graph as a JAX function ((input arrays in slot order, None) -> its outputs, no
    gradients), the input position each written output updates, and its layout (None: one device)."""
    return program._executables._infer, dict(program._written), program._layout or None


def long_lived(program: Program, position: int) -> bool:
    """Whether `program`'s input at `position` is a parameter, buffer or constant it only reads."""
    return program._long_lived[position]

