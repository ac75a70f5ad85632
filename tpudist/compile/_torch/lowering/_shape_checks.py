"""Shape checks eager torch makes in its CPU kernels and torch.export's meta kernels do not, made at
capture: a shape eager torch refuses is a `CaptureError` naming the op and both shapes, never a
number computed from mismatched tensors.

    F.cross_entropy(logits of shape (2, 3, 8, 8), target of shape (2, 4, 4))
    eager torch:  RuntimeError: size mismatch (got input: [2, 3, 8, 8] , target: [2, 4, 4])
    compiled:     CaptureError naming aten.cross_entropy_loss, both shapes and the user's line
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tpudist.compile._torch.lowering._captured import CaptureError, module_path
from tpudist.compile._torch.lowering import _observed


def _class_target(input_shape: tuple, target_shape: tuple, target_float: bool) -> str | None:
    """What torch's nll_loss / cross_entropy kernels refuse: None where the shapes fit."""
    if target_float:  # class probabilities: the input's shape exactly
        return None if target_shape == input_shape else "probabilities must have the input's shape"
    if len(input_shape) == 1:
        return None if len(target_shape) == 0 else "a 1-d input takes a 0-d target"
    want = (input_shape[0], *input_shape[2:])
    return None if target_shape == want else f"class indices must have shape {list(want)} (the input's without dim 1)"


# op name (the overload packet's) -> the check of its (input, target) shapes
_CHECKS: dict[str, Callable[[tuple, tuple, bool], str | None]] = {
    "cross_entropy_loss": _class_target,
    "nll_loss": _class_target,
    "nll_loss_nd": _class_target,
    "nll_loss2d": _class_target,
}


def check_shapes(graph: torch.fx.Graph) -> None:
    """Raises CaptureError for the first node of `graph` (as exported, before decompositions) whose
    input shapes eager torch would refuse."""
    for node in graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_overloadpacket"):
            continue
        check = _CHECKS.get(node.target._overloadpacket.__name__)
        if check is None or len(node.args) < 2:
            continue
        values = [_val(a) for a in node.args[:2]]
        if not all(isinstance(v, torch.Tensor) for v in values):
            continue
        given, target = values
        problem = check(tuple(given.shape), tuple(target.shape), target.dtype.is_floating_point)
        if problem is not None:
            raise CaptureError(
                f"torch -> XLA: {node.target} in {module_path(node)} gets input {list(given.shape)} and target "
                f"{list(target.shape)}: {problem}. Eager torch raises 'size mismatch' here; fix the shapes (the op "
                f"is at {_observed.user_line(node)}).")


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
