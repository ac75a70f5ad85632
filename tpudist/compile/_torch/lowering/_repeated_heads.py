"""Heads repeated before attention, seen through: transformers' `repeat_kv` (each key/value head
copied for the query heads that share it, then `scaled_dot_product_attention` with a mask) is
grouped-query attention on the heads as they are. The capture (`_capture._keep_attention`) hands
the attention op the unrepeated keys and values with `enable_gqa`, and the lowering attends each
group without copying the keys and values per query head (in decoding: the whole static cache,
per layer and token).
"""

from __future__ import annotations

from typing import Any

import torch


def erase_unused(graph: torch.fx.Graph, node: Any) -> None:
    """Erases `node` and the chain of single-input view ops feeding it, as far as nothing else uses them."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and not node.users \
            and node.target in _SAME_VALUES | {torch.ops.aten.expand.default}:
        source = node.args[0]
        graph.erase_node(node)
        node = source


_SAME_VALUES = {torch.ops.aten.slice.Tensor, torch.ops.aten.unsqueeze.default, torch.ops.aten.view.default,
                torch.ops.aten.reshape.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
                torch.ops.aten._unsafe_view.default}


def unrepeated(node: Any) -> tuple[torch.fx.Node, int] | None:
    """(x, n) where `node` is each key/value head of x repeated n times in place, the way grouped-
    query attention code shares heads (transformers' `repeat_kv`: x[:, :, None].expand(b, h, n, s, d)
    .reshape(b, h * n, s, d)); None for anything else. Attention on x with enable_gqa is the same."""
    if not isinstance(node, torch.fx.Node) or node.target not in (torch.ops.aten.reshape.default,
                                                                  torch.ops.aten.view.default,
                                                                  torch.ops.aten._unsafe_view.default):
        return None
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and source.target is torch.ops.aten.clone.default:
        source = source.args[0]
    if not isinstance(source, torch.fx.Node) or source.target is not torch.ops.aten.expand.default:
        return None
    out, wide, narrow = (_shape(n) for n in (node, source, source.args[0]))
    if out is None or wide is None or narrow is None or len(out) != 4 or len(wide) != 5:
        return None
    b, h, n, s, d = wide
    if narrow != (b, h, 1, s, d) or out != (b, h * n, s, d):
        return None
    base = source.args[0]
    while isinstance(base, torch.fx.Node) and _shape(base) != (b, h, s, d):  # back through x[:, :, None]
        if base.target not in _SAME_VALUES or not _whole(base):
            return None
        base = base.args[0]
    return (base, n) if isinstance(base, torch.fx.Node) else None


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or any(not isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _whole(node: torch.fx.Node) -> bool:
    """Whether a node of `_SAME_VALUES` keeps every value of its input (a slice over all of a dim)."""
    if node.target is not torch.ops.aten.slice.Tensor:
        return True
    size = _shape(node.args[0])
    dim, start, end, step = (list(node.args[1:]) + [0, 0, None, 1][len(node.args) - 1:])[:4]
    return size is not None and (start or 0) == 0 and (end is None or end >= size[dim]) and (step or 1) == 1
