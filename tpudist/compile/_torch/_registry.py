"""The op registry: one table from ATen overloads to small JAX functions.

Every lowering is a plain function taking the ATen op's own arguments (tensors arrive as JAX
arrays, `torch.dtype`s as NumPy dtypes, `device=` / `layout=` / `pin_memory=` / `memory_format=`
already removed) and returning what the ATen op returns. A lowering that depends on its input's
memory layout (`as_strided`) declares `input_meta=True` and receives torch's recorded tensor as `meta=`. Adding an op is one decorated function in
one of the `ops/` family modules:

    @register(aten.tanh.default)
    def tanh(x):
        return jnp.tanh(x)

Random ops declare `random=True` (or a predicate on the node, for ops random only for some
arguments, e.g. attention with dropout) and receive a JAX PRNG key as their first argument; the key
is derived from a per-call seed, so no lowering ever reaches for global state.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

import torch

# ops that carry no computation once shapes are static; the interpreter skips them. The asserts on
# values (`_assert_async`: F.one_hot's class range) cannot run inside XLA, which has no run-time
# assertion: an out-of-range class goes unreported there, as an out-of-range gather index does
IGNORED_OPS = frozenset({
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten.sym_constrain_range_for_size.default,
})

SUPPORTED_OPS_HINT = "tpudist.supported_torch_ops()"


class UnsupportedOpError(NotImplementedError):
    """An ATen op (or an argument value of one) that the torch -> XLA bridge cannot lower.

    The message names the op, the module path where it occurs and where the supported ops are listed.
    """


@dataclass(frozen=True)
class Lowering:
    """One registry entry: the JAX function for an ATen overload."""

    op: Any
    fn: Callable[..., Any]
    random: bool | Callable[[Any], bool] = False  # or: is this node (torch.fx.Node) random?
    input_meta: bool = False  # receives `meta=`: the tensor torch recorded for its first argument


_REGISTRY: dict[Any, Lowering] = {}
_NAMED: dict[str, Lowering] = {}  # ops of other libraries, by name (see register_named)
# ops left to torch's own decomposition (torch._decomp), beyond torch.export's core-ATen table
_DECOMPOSED: set[Any] = set()
_KEPT: set[Any] = set()  # ops lowered whole although torch.export's table decomposes them


def register(*ops: Any, random: bool | Callable[[Any], bool] = False,
             input_meta: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as the lowering of every ATen overload in `ops`.

    Example:
        @register(aten.relu.default)
        def relu(x):
            return jax.nn.relu(x)
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            assert op not in _REGISTRY, f"{op} is registered twice ({_REGISTRY.get(op)} and {fn})"
            _REGISTRY[op] = Lowering(op, fn, random, input_meta)
        return fn
    return decorate


def register_named(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like `register`, for ops another library defines (e.g. "transformers.grouped_mm_fallback.default",
    the op's `str`): matched by name, so the library need not be imported before tpudist is."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            assert name not in _NAMED, f"{name} is registered twice"
            _NAMED[name] = Lowering(name, fn)
        return fn
    return decorate


def decompose_with_torch(*ops: Any) -> None:
    """Marks ATen overloads that capture decomposes with torch's own decomposition (from
    `torch._decomp`) instead of lowering them: for ops whose torch decomposition is exact and
    lowers to supported ops (e.g. `addbmm` into `bmm` and a sum)."""
    from torch._decomp import decomposition_table
    for op in ops:
        assert op in decomposition_table, f"torch has no decomposition of {op}"
        assert op not in _REGISTRY, f"{op} is both lowered and decomposed"
        _DECOMPOSED.add(op)


def keep_whole(*ops: Any) -> None:
    """Marks registered ATen overloads that capture keeps whole although torch.export's core-ATen
    table decomposes them: where the decomposition differentiates worse than torch's own kernel
    (`special_log_ndtr` as a `where` of two branches: NaN gradients, 0 * inf, for |x| > 5)."""
    _KEPT.update(ops)


def torch_decompositions() -> tuple[dict[Any, Callable[..., Any]], frozenset]:
    """The decompositions `decompose_with_torch` asked for, as a table for run_decompositions, and
    the ops `keep_whole` takes out of torch.export's table."""
    from torch._decomp import decomposition_table
    _load_families()
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
    _load_families()
    found = _REGISTRY.get(op)
    return found if found is not None or not _NAMED else _NAMED.get(str(op))


def supported_ops() -> list[str]:
    """Names of every ATen overload the bridge lowers, sorted, e.g. `['aten._log_softmax.default', ...]`."""
    _load_families()
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


def _load_families() -> None:
    # the family modules register themselves on import; importing here (not at module top) keeps the
    # registry importable from the family modules without a cycle
    from tpudist.compile._torch import ops  # noqa: F401
