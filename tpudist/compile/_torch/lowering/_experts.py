"""While capturing for expert parallelism: `transformers`' experts modules as `tpudist::experts`.

`transformers` stores a mixture-of-experts layer's experts as stacked weights (`gate_up_proj`
(E, 2I, H), `down_proj` (E, H, I)) in a module called as `experts(hidden, top_k_index,
top_k_weights)` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and their kin, `use_experts_implementation`).
Its torch code sorts the pairs and slices rows by count; as one op, the lowering
(`ops/experts.py`) can send the pairs to the devices that hold their experts instead. The router,
its top-k and its auxiliary loss stay the model's own code.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from tpudist.compile._torch._custom_ops import EXPERTS

_ACTIVATIONS = {torch.nn.SiLU: "silu", torch.nn.ReLU: "relu"}


def activation(module: torch.nn.Module) -> str | None:
    """The experts' activation by name (as `ops/experts.ACTIVATIONS` lowers it), None if unknown."""
    act = getattr(module, "act_fn", None)
    if type(act) in _ACTIVATIONS:
        return _ACTIVATIONS[type(act)]
    if isinstance(act, torch.nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    name = type(act).__name__
    return {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
            "GELUTanh": "gelu_tanh", "SiLUActivation": "silu"}.get(name)


def why_not(module: torch.nn.Module) -> str | None:
    """None when an experts module (`experts_modules`) is one the op computes exactly, else what differs."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if not hasattr(module, "has_gate"):  # not through transformers' use_experts_implementation: its own forward
        return "a forward of its own (not transformers' use_experts_implementation)"
    flags = {"has_gate": True, "has_bias": False, "is_concatenated": True, "is_transposed": False,
             "has_post_expert_norm": False}
    for flag, want in flags.items():
        if getattr(module, flag, want) != want:
            return f"{flag}={not want}"
    from transformers.integrations import moe
    if getattr(type(module), "_apply_gate", None) is not moe._default_apply_gate:
        return "its own _apply_gate"
    experts, width = gate_up.shape[0], gate_up.shape[2]
    if down.shape[0] != experts or down.shape[1] != width or gate_up.shape[1] != 2 * down.shape[2]:
        return f"weights of shapes {tuple(gate_up.shape)} and {tuple(down.shape)}"
    if activation(module) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}"
    return None


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules of `model` that look like `transformers`' experts (stacked 3-d `gate_up_proj`
    and `down_proj`), by path."""
    def stacked(m: torch.nn.Module, name: str) -> bool:
        weight = getattr(m, name, None)
        return isinstance(weight, torch.nn.Parameter) and weight.ndim == 3
    return {path: m for path, m in model.named_modules() if stacked(m, "gate_up_proj") and stacked(m, "down_proj")}


def check_experts(model: torch.nn.Module, where: str = "") -> None:
    """Expert parallelism was asked for: an experts module of `model` the op does not compute
    exactly is an error naming it and the way out."""
    for path, module in experts_modules(model).items():
        reason = why_not(module)
        if reason is not None:
            raise NotImplementedError(
                f"expert parallelism: the experts module '{path}' ({type(module).__name__}) has {reason}; tpudist's "
                f"experts op computes stacked gate_up_proj/down_proj experts with a gated SiLU/GELU/ReLU. Train it "
                f"without an 'expert' mesh axis (FSDP splits its weights){where}")


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[None]:
    """Every experts module of `model` (checked by `check_experts`) calls `tpudist::experts` while
    the context is open."""
    patched = []
    try:
        for module in experts_modules(model).values():
            module.forward = _as_op(module)  # an instance attribute: nn.Module.__call__ finds it first
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def _as_op(module: torch.nn.Module) -> Any:
    act = activation(module)

    def forward(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        # (hidden_states, top_k_index, top_k_weights), as the model passes them (names differ by family)
        hidden_states, top_k_index, top_k_weights = (*args, *kwargs.values())
        return EXPERTS(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, act)
    return forward
