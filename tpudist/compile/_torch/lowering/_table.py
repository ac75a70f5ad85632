"""The op table: ATen overloads -> small JAX functions, filled by the `ops/` family modules as they load.

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


class MissingOp:
    """An ATen op or overload the running torch does not have (`aten.cholesky` left torch 2.14).

    The op families name ops through `aten` below; a name torch lacks comes back as a MissingOp,
    which `register`, `decompose_with_torch` and `keep_whole` skip and record, so that a torch
    release that drops or renames an op costs that op's lowering, never the import of tpudist.
    `missing_ops()` lists them (`tpudist doctor` prints them)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> "MissingOp":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingOp(f"{self.name}.{attr}")

    def __repr__(self) -> str:
        return f"MissingOp({self.name!r})"


class _Packet:
    """One ATen op's overloads, by name; an overload the running torch lacks is a MissingOp."""

    __slots__ = ("_packet", "_name")

    def __init__(self, packet: Any, name: str) -> None:
        self._packet, self._name = packet, name

    def __getattr__(self, overload: str) -> Any:
        try:
            return getattr(self._packet, overload)
        except AttributeError:
            return MissingOp(f"{self._name}.{overload}")


class _Aten:
    """`torch.ops.aten` for the op table: `aten.NAME.OVERLOAD` is the real OpOverload where the
    running torch has it, else a MissingOp."""

    def __getattr__(self, name: str) -> Any:  # (aten has dunder ops too: aten.__lshift__)
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            return MissingOp(f"aten.{name}")
        return _Packet(packet, f"aten.{name}")


aten = _Aten()


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
_MISSING: dict[str, str] = {}  # op name -> what the table wanted it for, for ops this torch lacks


def _present(ops: tuple[Any, ...], why: str) -> list[Any]:
    """`ops` less the ones this torch lacks, which are recorded in `_MISSING` as wanted for `why`."""
    found = []
    for op in ops:
        if isinstance(op, MissingOp):
            _MISSING.setdefault(op.name, why)
        else:
            found.append(op)
    return found


def missing_ops() -> dict[str, str]:
    """The ATen ops the op table names that the running torch does not have, each with what the
    table wanted it for ("lowering", "decomposition", "kept whole"); empty on the torch it was
    written against."""
    return dict(sorted(_MISSING.items()))


def register(*ops: Any, random: bool | Callable[[Any], bool] = False,
             input_meta: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as the lowering of every ATen overload in `ops`.

    Example:
        @register(aten.relu.default)
        def relu(x):
            return jax.nn.relu(x)
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in _present(ops, "lowering"):
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
    for op in _present(ops, "decomposition"):
        if op not in decomposition_table:  # this torch release dropped it: the op stays unsupported
            _MISSING.setdefault(str(op), "decomposition (this torch has none)")
            continue
        assert op not in _REGISTRY, f"{op} is both lowered and decomposed"
        _DECOMPOSED.add(op)


def keep_whole(*ops: Any) -> None:
    """Marks registered ATen overloads that capture keeps whole although torch.export's core-ATen
    table decomposes them: where the decomposition differentiates worse than torch's own kernel
    (`special_log_ndtr` as a `where` of two branches: NaN gradients, 0 * inf, for |x| > 5)."""
    _KEPT.update(_present(ops, "kept whole"))
