"""Outputs that hold objects torch.export does not know: flattened to tensors, rebuilt after the call.

A model called the way its documentation calls it may return objects that are neither tensors nor
registered pytree nodes: Hugging Face causal LMs return their key/value cache (`DynamicCache`,
`EncoderDecoderCache`) inside the `ModelOutput`. torch.export refuses such outputs. The capture
therefore exports `flat_outputs(module)`, whose forward returns only the output's tensors, and keeps
a `Template` of everything else; `Template.rebuild(tensors)` gives back an object of the same
classes holding the computed tensors: what the user gets in eager mode.

Rebuilding copies (shallowly) every object on the way from the output's root to a tensor and
sets the computed tensors in place of the traced ones; everything else (config objects, Python
numbers, None) is shared with the object seen while tracing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpudist.compile._torch.lowering._table import UnsupportedOpError

_MAX_DEPTH = 12  # objects nest a few levels (cache -> layers -> tensors); deeper is not output data


@dataclass(frozen=True)
class _Slot:
    index: int  # position in the flat tensor list


@dataclass(frozen=True)
class _Object:
    """An object with tensors among its attributes: a shallow copy gets the rebuilt attributes."""

    template: Any
    attributes: dict[str, Any]


@dataclass(frozen=True)
class _Tree:
    """A pytree node torch knows (tuple, list, dict, ModelOutput, ...) and its rebuilt leaves."""

    spec: Any
    leaves: list[Any]


@dataclass(frozen=True)
class _Constant:
    value: Any


class Template:
    """The structure of one output: which tensor goes where, and the non-tensor parts."""

    def __init__(self, root: Any, count: int):
        self._root, self.count = root, count

    def rebuild(self, tensors: list[Any]) -> Any:
        """The output with `tensors` (in flattening order) in place of the traced tensors."""
        assert len(tensors) == self.count, (len(tensors), self.count)
        return _rebuild(self._root, tensors)


def flatten(value: Any) -> tuple[list[torch.Tensor], Template]:
    """(every tensor of `value`, in a fixed order; the template that puts them back)."""
    tensors: list[torch.Tensor] = []
    root = _describe(value, tensors, 0, set())
    return tensors, Template(root, len(tensors))


def _describe(value: Any, tensors: list[torch.Tensor], depth: int, seen: set[int]) -> Any:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        # a value read out of a tensor while tracing (`.item()`): kept, it would be the symbol itself
        raise UnsupportedOpError(
            f"torch -> XLA: the forward returns a Python {type(value).__name__[3:].lower()} computed from a "
            f"tensor's values ({value}: .item(), .tolist(), int() or float() of a tensor); a compiled module "
            "returns tensors: return the tensor and call .item() on the result")
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, torch.Size):
        return _Constant(value)
    leaves, spec = tree_flatten(value, is_leaf=_is_size)
    if not (len(leaves) == 1 and leaves[0] is value):  # a container torch's pytree knows
        return _Tree(spec, [_describe(leaf, tensors, depth + 1, seen) for leaf in leaves])
    if depth >= _MAX_DEPTH or id(value) in seen or isinstance(value, torch.nn.Module) \
            or not _holds_tensors(value, depth, set()):
        return _Constant(value)
    seen = seen | {id(value)}
    attributes = {name: _describe(item, tensors, depth + 1, seen) for name, item in _attributes(value)
                  if _holds_tensors(item, depth + 1, set())}
    return _Object(value, attributes)


def _is_size(value: Any) -> bool:
    # a shape is static here, and torch's pytree would rebuild a torch.Size as a plain tuple
    return isinstance(value, torch.Size)


def _attributes(value: Any) -> list[tuple[str, Any]]:
    names = list(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str) and hasattr(value, n)]
    return [(n, getattr(value, n)) for n in dict.fromkeys(names)]


def _holds_tensors(value: Any, depth: int, seen: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth >= _MAX_DEPTH or id(value) in seen or isinstance(value, (torch.nn.Module, str, bytes, int, float)) \
            or value is None:
        return False
    seen.add(id(value))
    leaves, _ = tree_flatten(value)
    if not (len(leaves) == 1 and leaves[0] is value):
        return any(_holds_tensors(leaf, depth + 1, seen) for leaf in leaves)
    return any(_holds_tensors(item, depth + 1, seen) for _, item in _attributes(value))


def _rebuild(node: Any, tensors: list[Any]) -> Any:
    if isinstance(node, _Slot):
        return tensors[node.index]
    if isinstance(node, _Tree):
        return tree_unflatten([_rebuild(leaf, tensors) for leaf in node.leaves], node.spec)
    if isinstance(node, _Object):
        value = copy.copy(node.template)
        for name, child in node.attributes.items():
            object.__setattr__(value, name, _rebuild(child, tensors))
        return value
    return node.value


class FlatOutputs(torch.nn.Module):
    """`module`'s forward, run inside `context()`, returning a flat list of tensors; `template()` is
    the structure seen by the last trace.

    The module is registered under the name `traced`, so the captured graph names parameters
    `traced.<fqn>` (the capture strips that prefix again)."""

    PREFIX = "traced."

    def __init__(self, module: torch.nn.Module, context: Callable[[], Any]):
        super().__init__()
        self.traced = module
        self.context = context
        # written through a plain object: torch.export restores (copies of) module attributes and
        # containers assigned while tracing
        self._last = _Holder()

    def template(self) -> Template | None:
        return self._last.template

    def forward(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        with self.context():
            value = self.traced(*args, **kwargs)
        tensors, self._last.template = flatten(value)
        return tensors


class _Holder:
    template: Template | None = None
