"""The op registry: what the lowering looks up, with every `ops/` family module loaded.

The table itself lives in `_table` (which the family modules fill as they import); this module imports
them all first, so a lookup here sees every lowering.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

__all__ = ["IGNORED_OPS", "SUPPORTED_OPS_HINT", "Lowering", "UnsupportedOpError", "register", "torch_decompositions",
           "is_random", "lookup", "supported_ops", "unsupported_message"]

from tpudist.compile._torch.lowering import ops  # noqa: F401  (the families register themselves on import)
from tpudist.compile._torch.lowering._table import (  # noqa: F401  (re-exported: the registry's public names)
    _DECOMPOSED,
    _KEPT,
    _NAMED,
    _REGISTRY,
    IGNORED_OPS,
    SUPPORTED_OPS_HINT,
    Lowering,
    UnsupportedOpError,
    register,
)


def torch_decompositions() -> tuple[dict[Any, Callable[..., Any]], frozenset]:
    """The decompositions `decompose_with_torch` asked for, as a table for run_decompositions, and
    the ops `keep_whole` takes out of torch.export's table."""
    from torch._decomp import decomposition_table
    for op in _KEPT:
        assert op in _REGISTRY, f"{op} is kept whole but has no lowering"
    return {op: decomposition_table[op] for op in _DECOMPOSED}, frozenset(_KEPT)


def is_random(node: Any) -> bool:
    """Whether the graph node draws random numbers (and so takes a PRNG key)."""
    lowering = lookup(node.target)
    if lowering is None:
        return False
    return lowering.random(node) if callable(lowering.random) else lowering.random



def lookup(op: Any) -> Lowering | None:
    """The lowering of `op`, or None when the bridge does not support it."""
    found = _REGISTRY.get(op)
    return found if found is not None or not _NAMED else _NAMED.get(str(op))


def supported_ops() -> list[str]:
    """Names of every ATen overload the bridge lowers, sorted, e.g. `['aten._log_softmax.default', ...]`."""
    return sorted([str(op) for op in _REGISTRY] + list(_NAMED))


def unsupported_message(op: Any, where: str) -> str:
    """The error text for an op with no lowering: the op, where it is, the nearest supported names."""
    name = str(op)
    supported = supported_ops()
    packet = name.rsplit(".", 1)[0] + "."
    siblings = [s for s in supported if s.startswith(packet)]
    near = siblings or difflib.get_close_matches(name, supported, n=4, cutoff=0.6)
    hint = f"; supported near it: {', '.join(near)}" if near else ""
    return (f"torch -> XLA: op {name} (in {where}) has no XLA lowering{hint}. "
            f"The {len(supported)} supported ops are listed by {SUPPORTED_OPS_HINT}; rewrite that part of "
            "the model with supported ops, or keep it outside the compiled module.")
