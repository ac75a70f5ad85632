"""One eager collective call, from the caller's values to the engine and back, and the repeat
path that lets a recurring small value skip everything but the copies (docs/collectives.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tpudist.collectives import _convert
from tpudist.collectives._engine import Engine, Op, engine, normalize_groups

# Host values (torch tensors, numpy arrays, scalars) of at most this many bytes per process, all
# leaves of a call together, go through the engine's staging buffers and come back as copies: for
# them a fresh buffer import and a DLPack export cost more than the copies (docs/collectives.md).
STAGE_MAX_BYTES = 64 << 10


def run(name: str, params: dict[str, Any], x: Any, groups: Any,
        body: Callable[[list[jax.Array], int], list[jax.Array]],
        check: Callable[[list[_convert.Leaf], int], None] | None,
        detail: tuple[tuple[str, Any], ...]) -> Any:
    """Runs collective `name` on `x` over `groups`: `check` validates the values' descriptions,
    `body` is the in-graph computation on the engine's blocks; the result has `x`'s structure."""
    eng = engine()
    repeats = _repeats(eng)
    key = repeat_key(name, params, x, groups)
    repeat = repeats.get(key) if key is not None else None
    if repeat is not None:
        return repeat(x)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    descs = [_convert.describe(leaf) for leaf in leaves]
    norm = normalize_groups(groups, eng.n)
    if check is not None:
        check(descs, len(norm[0]))
    if leaves[0] is not x and not detail:  # a pytree: its structure (dict keys too) is agreed on
        detail = (("structure", str(treedef)),)
    op = Op(name, tuple(sorted(params.items())), body, detail)
    # jax values stay XLA buffers (a staged one could come back as the staging buffer itself).
    small = (eng.device.platform == "cpu" and sum(d.nbytes for d in descs) <= STAGE_MAX_BYTES
             and all(d.kind != "jax" for d in descs))
    with jax.enable_x64(True):
        if small:
            blocks = [_convert.host_block(leaf, d) for leaf, d in zip(leaves, descs)]
        else:
            blocks = [_convert.to_block(leaf, d, eng.device) for leaf, d in zip(leaves, descs)]
        outs = eng.run(op, norm, blocks)
        results = [_convert.from_block(o, d, o.shape[2:], copy=small) for o, d in zip(outs, descs)]
    if small and key is not None and leaves[0] is x and key not in repeats:
        # None (no staging for this signature, e.g. bfloat16) is remembered too: not retried per call
        repeats[key] = _repeat(eng, op, norm, blocks, descs[0])
    return jax.tree_util.tree_unflatten(treedef, results)


# The repeat path for small single values. A training loop calls the same collective on a value of
# the same kind, dtype and shape every step (a loss, a counter, a flag): after the first call,
# which validates, checks peers, compiles and builds the staging buffer, later ones only copy the
# value in, run and copy the result out (docs/collectives.md). The key is the call's collective,
# parameters and groups (everything a collective's check reads besides the values' descriptions)
# and the value's `_convert.fingerprint` (everything its description is computed from), so a call
# the full path would treat differently never takes another's repeat path.

_repeat_table: tuple[Engine | None, dict[Any, Callable[[Any], Any] | None]] = (None, {})


def _repeats(eng: Engine) -> dict[Any, Callable[[Any], Any] | None]:
    """The repeat paths built on `eng`; a new engine (a new job) starts with none."""
    global _repeat_table
    if _repeat_table[0] is not eng:
        _repeat_table = (eng, {})
    return _repeat_table[1]


def repeat_key(name: str, params: dict[str, Any], x: Any, groups: Any) -> Any:
    """The repeat-path key of a call, or None where groups or parameters are not hashable (the
    full path then reports what is wrong with them)."""
    try:
        key = (name, tuple(params.items()), None if groups is None else tuple(map(tuple, groups)),
               _convert.fingerprint(x))
        hash(key)
    except TypeError:
        return None
    return key


def _repeat(eng: Engine, op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[np.ndarray],
            leaf: _convert.Leaf) -> Callable[[Any], Any] | None:
    """The repeat path of a single staged value described by `leaf`, or None."""
    found = eng.repeat(op, groups, blocks)
    if found is None:
        return None
    call, (host,) = found
    view = host.reshape(leaf.shape)
    if leaf.kind == "torch":
        stage = _convert.torch_view(view)
        fill: Callable[[Any], Any] = lambda x: stage.copy_(x.detach())  # any strides, no autograd
    else:
        fill = lambda x: np.copyto(view, x)  # noqa: E731 - numpy arrays and Python scalars

    def repeat(x: Any) -> Any:
        with jax.enable_x64(True):
            (out,) = call(lambda: fill(x))
            return _convert.from_block(out, leaf, out.shape[2:], copy=True)
    return repeat
