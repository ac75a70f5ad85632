"""Lowering: a captured core-ATen graph -> one JAX function, by walking it through the registry.

The function takes the graph's tensor inputs (as JAX arrays, in placeholder order, literals left
out) and a JAX PRNG key (None when the graph draws no random numbers), and returns the graph's
outputs. Traced under `jax.jit`, every op becomes XLA HLO; nothing of torch remains at run time.
A lowering that fails while tracing is an UnsupportedOpError naming the op and its module path.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpudist.compile._torch._capture import Captured, module_path
from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch._registry import IGNORED_OPS, UnsupportedOpError, is_random, lookup
from tpudist.compile._torch.ops import linalg

# keyword arguments that describe torch placement or layout, meaningless to XLA
_PLACEMENT_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format", "non_blocking"})


def lower(captured: Captured) -> Callable[[Sequence[jax.Array], Any], tuple[Any, ...]]:
    """The JAX function computing `captured`'s graph: `run(tensor_inputs, key) -> outputs`; `key` is a
    JAX PRNG key when `captured.has_random`, else ignored."""
    nodes = list(captured.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    literals = {node: slot.value for node, slot in zip(placeholders, captured.inputs) if slot.kind == "literal"}
    tensor_placeholders = [n for n in placeholders if n not in literals]

    def run(tensors: Sequence[jax.Array], key: Any) -> tuple[Any, ...]:
        assert len(tensors) == len(tensor_placeholders), (len(tensors), len(tensor_placeholders))
        env: dict[torch.fx.Node, Any] = dict(literals)
        env.update(zip(tensor_placeholders, tensors))
        for position, node in enumerate(nodes):
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                env[node] = _conform(env[node.args[0]][node.args[1]], node)
            elif node.target not in IGNORED_OPS:
                env[node] = _apply(node, env, key, position)
        output = next(n for n in nodes if n.op == "output")
        return tuple(_read(value, env) for value in output.args[0])

    return run


def _broadcast_matrix(operand: Any) -> torch.fx.Node | None:
    """The 2-D tensor that a bmm operand merely repeats over the batch, or None.

    Decomposing `linear` / `matmul` on a non-contiguous 3-D input (MultiheadAttention's input
    projection, for one) gives `bmm(x, view(expand(w, [b, k, n])))`: b small matrix products
    against one weight. One (b*m, k) x (k, n) product computes the same and is far faster on XLA."""
    node = operand
    if isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.view.default:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not torch.ops.aten.expand.default:
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if isinstance(value, torch.Tensor) and value.ndim == 2 and list(node.args[1][1:]) == list(value.shape):
        return source
    return None


def _transposed_matrix(operand: Any) -> torch.fx.Node | None:
    """The 2-D tensor `w` when a matmul operand is `w.t()` (`permute(w, [1, 0])`), else None.

    `linear` decomposes to `addmm(b, x, permute(w, [1, 0]))`. Contracting x with w's second
    dimension directly gives XLA the same product, and makes autodiff keep `w` itself for the
    backward instead of a transposed copy, which the forward would otherwise have to write out
    every step (one copy of every weight matrix)."""
    if not isinstance(operand, torch.fx.Node) or operand.target not in (
            torch.ops.aten.permute.default, torch.ops.aten.t.default):
        return None
    if operand.target is torch.ops.aten.permute.default and list(operand.args[1]) != [1, 0]:
        return None
    source = operand.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return source if isinstance(value, torch.Tensor) and value.ndim == 2 else None


def _apply(node: torch.fx.Node, env: dict, key: Any, position: int) -> Any:
    aten = torch.ops.aten
    if node.target is aten.bmm.default:
        weight = _broadcast_matrix(node.args[1])
        if weight is not None:
            return _conform(linalg.product(_read(node.args[0], env), env[weight]), node)
    elif node.target is aten.mm.default or (node.target is aten.addmm.default and not node.kwargs):
        matrix, other = (node.args[1], node.args[0]) if node.target is aten.mm.default else (node.args[2], node.args[1])
        weight = _transposed_matrix(matrix)
        a = _read(other, env)
        if weight is not None and getattr(a, "ndim", 0) == 2:
            product = linalg.contract_last(a, env[weight])
            if node.target is aten.addmm.default:
                product = linalg.with_bias(_read(node.args[0], env), product)
            return _conform(product, node)
    lowering = lookup(node.target)
    assert lowering is not None, f"{node.target} passed capture's op check but has no lowering"
    args = [_read(a, env) for a in node.args]
    kwargs = {k: _read(v, env) for k, v in node.kwargs.items() if k not in _PLACEMENT_KWARGS}
    if is_random(node):
        args.insert(0, jax.random.fold_in(key, position))
    if lowering.input_meta:
        kwargs["meta"] = node.args[0].meta.get("val")
    try:
        result = lowering.fn(*args, **kwargs)
    except UnsupportedOpError as exc:
        raise UnsupportedOpError(f"{exc} (in {module_path(node)})") from None
    except Exception as exc:  # a lowering meeting arguments it was not written for
        raise UnsupportedOpError(
            f"torch -> XLA: lowering {node.target} (in {module_path(node)}) failed for arguments "
            f"{_describe_args(node)}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. "
            "Rewrite that part of the model with other torch ops, or keep it outside the compiled module; "
            "please report it with this message.") from exc
    if isinstance(result, (tuple, list)):
        return result  # multi-output ops are conformed element by element when read (getitem)
    return _conform(result, node)


def _describe_args(node: torch.fx.Node) -> str:
    def one(a: Any) -> str:
        value = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {value.dtype}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(one(v) for v in value) + "]"
        return repr(value)
    parts = [one(a) for a in node.args] + [f"{k}={one(v)}" for k, v in node.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _read(value: Any, env: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        return env[value]
    if isinstance(value, (list, tuple)):
        return type(value)(_read(v, env) for v in value)
    if isinstance(value, torch.dtype):
        return jax_dtype(value)
    return value


def _conform(value: Any, node: torch.fx.Node) -> Any:
    """Casts a lowering's result to the dtype torch recorded for the node, and checks its shape."""
    expected = node.meta.get("val")
    if not isinstance(expected, torch.Tensor):
        return value
    value = jnp.asarray(value)
    dtype = jax_dtype(expected.dtype)
    if value.dtype != dtype:
        value = value.astype(dtype)
    assert value.shape == tuple(expected.shape), (
        f"lowering of {node.target} ({module_path(node)}) returned shape {value.shape}, torch expects "
        f"{tuple(expected.shape)}")
    return value
