"""A model built under `torch.device("meta")` initialised straight into its shards: one module at a time.

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters())
    step = tpudist.compile_train_step(model, None, opt, mesh=mesh, sharding="fsdp")

Each module's own parameters and buffers are made real on the host, initialised by the model's own
code (a Hugging Face model's `_init_weights`, else the module's `reset_parameters`), and each
parameter crosses to the devices as this process's shards; its host tensor is then swapped for a
placeholder of the same shape that holds one element. So a process never holds more than one
module's parameters on the host (plus its own shards), and the tensors keep their identity (the
optimizer built on the meta model keeps working). Every process must draw the same values: seed
torch identically (`torch.manual_seed`) on every process, as for any model.

Values start as NaN, so a parameter that its module's initialisation leaves unset is an error
naming it, never uninitialised memory trained on.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import torch


def on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def hollow(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a placeholder left by `materialize` (its values live on the devices only)."""
    return tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


def materialize(model: torch.nn.Module, put: Any) -> dict[int, jax.Array]:
    """Initialises every meta parameter and buffer of `model` module by module (see the module
    docstring); returns each parameter's device array by `id` (`put(tensor, parameter)` places it)."""
    hf_init = getattr(model, "_init_weights", None)
    arrays: dict[int, jax.Array] = {}
    for name, module in model.named_modules():
        own = [t for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
               if t.is_meta]
        if not own:
            continue
        for t in own:
            real = torch.full(t.shape, float("nan"), dtype=t.dtype) if t.dtype.is_floating_point \
                else torch.zeros(t.shape, dtype=t.dtype)
            torch.utils.swap_tensors(t, torch.nn.Parameter(real, requires_grad=t.requires_grad)
                                     if isinstance(t, torch.nn.Parameter) else real)
        with torch.no_grad():
            if hf_init is not None:
                hf_init(module)
            if _unset(module) and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        unset = _unset(module)
        if unset:
            raise ValueError(f"{type(model).__name__} was built on the meta device, and the initialisation of "
                             f"{name or 'the model'} ({type(module).__name__}) left {', '.join(unset)} unset "
                             "(no _init_weights or reset_parameters sets it); build the model on the CPU, or give "
                             "the module a reset_parameters()")
        for p in module.parameters(recurse=False):
            if id(p) in arrays:
                continue
            arrays[id(p)] = put(p.detach(), p)
            # NaN where it can be: a read that bypasses every door shows it, never plausible numbers
            hole = torch.full((), float("nan") if p.dtype.is_floating_point else 0, dtype=p.dtype).expand(p.shape)
            torch.utils.swap_tensors(p, torch.nn.Parameter(hole, requires_grad=p.requires_grad))
    return arrays


def _unset(module: torch.nn.Module) -> list[str]:
    named = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    return [n for n, t in named if t.dtype.is_floating_point and not hollow(t) and bool(torch.isnan(t).any())]
