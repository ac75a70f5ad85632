"""The step cache: what follows torch.export, kept on disk and keyed by the exported graph itself.

A fresh process pays, for its first fused step, torch.export, the decomposition to core ATen, the
lowering of every node to JAX (tracing) and JAX's lowering to StableHLO; XLA's executable already
comes from JAX's persistent cache. This cache keeps the rest, in two entries under the persistent
cache's directory (`TPUDIST_CACHE_DIR`, `<dir>/tpudist-steps`):

- **capture** entries, keyed by the exported program before decomposition (`graph_key`): every
  node's op, arguments, value shape/dtype/strides, module path and tpudist's own marks, the graph
  signature, the torch / JAX / tpudist versions, a hash of tpudist's source and the lowering
  switches. The entry holds what the decomposed graph told (input and output slots, which inputs a
  gradient reaches, random ops): a hit skips the decomposition, which runs later only if something
  must lower the graph after all (and must then agree with the entry, or the step raises);
- **step** entries, keyed by a capture key and the rest of the step as JAX traces it with the
  model's graph replaced by a stand-in of its outputs' shapes (`step_key`): the optimizer, clipping,
  averaging, shardings and the arguments' shapes. The entry is the lowered step as a serialized
  `jax.export.Exported`; a hit compiles it (XLA's cache hit) without tracing the graph at all.

A changed forward (other code, same shapes) changes the exported graph and misses; so does any other
torch, JAX or tpudist (source included). Graphs the key cannot describe completely are not cached:
custom autograd Functions (their backward is Python the graph does not show), ops lowered by
functions outside tpudist, nested graphs, and specialisations on data (`lowering._observed`).
`TPUDIST_STEP_CACHE=0` turns the cache off; `TPUDIST_CACHE_DIR=off` turns it off with XLA's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tpudist.compile")
FORMAT = 1  # the entries' layout; bumped when it changes
SWITCH_ENV = "TPUDIST_STEP_CACHE"


class Uncacheable(Exception):
    """The graph holds something the key cannot describe; the reason is the message."""


def directory() -> Path | None:
    """`<TPUDIST_CACHE_DIR>/tpudist-steps`, or None where the cache is off."""
    from tpudist._runtime import cache_dir
    if os.environ.get(SWITCH_ENV, "1").lower() in ("0", "off", "false"):
        return None
    base = cache_dir()
    if base is None or "://" in base:  # (a remote cache: XLA's own only)
        return None
    return Path(base) / "tpudist-steps"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The versions and tpudist's own source: any change to either misses every entry."""
    import jax
    digest = hashlib.sha256(f"{FORMAT}|{torch.__version__}|{jax.__version__}|{metadata.version('jaxlib')}".encode())
    root = Path(__file__).resolve().parents[3]  # the tpudist package
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _registry_fingerprint() -> str:
    """The op table's size; Uncacheable where a lowering comes from outside tpudist (its code is
    not in the source hash)."""
    from tpudist.compile._torch.lowering import _table
    for entry in (*_table._REGISTRY.values(), *_table._NAMED.values()):
        module = getattr(entry.fn, "__module__", "") or ""
        if not module.startswith("tpudist."):
            raise Uncacheable(f"a lowering registered outside tpudist ({module}.{entry.fn.__qualname__})")
    return f"{len(_table._REGISTRY)}/{len(_table._NAMED)}/{len(_table._DECOMPOSED)}/{len(_table._KEPT)}"


def graph_key(program: torch.export.ExportedProgram, switches: tuple) -> str:
    """The capture key of `program` (exported, not yet decomposed) under `switches` (the capture's
    options and the lowering's environment); Uncacheable naming what it cannot describe."""
    from tpudist.compile._torch.lowering import _custom_grad
    digest = hashlib.sha256(f"{code_fingerprint()}|{_registry_fingerprint()}|{switches!r}".encode())
    gm = program.graph_module
    if any(isinstance(child, torch.fx.GraphModule) for child in gm.children()):
        raise Uncacheable("a nested graph (a higher-order op: cond, a checkpointed or compiled region)")
    for node in program.graph.nodes:
        if node.target is _custom_grad.AUTOGRAD_FUNCTION:
            raise Uncacheable("a custom autograd.Function")
        if node.op == "get_attr":  # a tensor attribute torch.export did not lift: its values are not in the key
            raise Uncacheable(f"an attribute read ({node.target})")
        stack = node.meta.get("nn_module_stack") or {}
        line = (node.name, node.op, _target(node.target), _arg(node.args), _arg(node.kwargs),
                _value(node.meta.get("val")), [(p, _type_name(t)) for p, t in stack.values()],
                _arg(node.meta.get("custom") or {}))
        digest.update(repr(line).encode())
    signature = program.graph_signature
    digest.update(repr([(s.kind.name, s.target, _arg(getattr(s.arg, "value", None)) if _is_constant(s.arg)
                         else s.arg.name) for s in signature.input_specs]).encode())
    digest.update(repr([(s.kind.name, s.target) for s in signature.output_specs]).encode())
    return digest.hexdigest()


def _is_constant(arg: Any) -> bool:
    return isinstance(arg, torch.export.graph_signature.ConstantArgument)


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(target)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or name is None or "<" in name:
        raise Uncacheable(f"a call of {target!r}, which has no stable name")
    return f"{module}.{name}"


def _type_name(kind: Any) -> str:
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def _arg(value: Any) -> Any:
    """A node argument as plain, comparable data; Uncacheable for values it cannot spell out."""
    if isinstance(value, torch.fx.Node):
        return ("%", value.name)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_arg(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _arg(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, complex)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("torch", str(value))
    if isinstance(value, slice):
        return ("slice", _arg(value.start), _arg(value.stop), _arg(value.step))
    raise Uncacheable(f"an argument of type {type(value).__name__}")


def _value(value: Any) -> Any:
    """A node's recorded value: shape, dtype, strides and device kind of a tensor."""
    if isinstance(value, torch.Tensor):
        if any(not isinstance(s, int) for s in value.shape):
            raise Uncacheable("a shape that depends on values")
        return ("t", tuple(value.shape), str(value.dtype), tuple(value.stride()), value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_value(v) for v in value)
    if isinstance(value, torch.SymInt):
        raise Uncacheable("a symbolic size")
    return _arg(value)


def load(kind: str, key: str) -> Any | None:
    """The `kind` entry stored under `key`, or None (absent, unreadable or of another format)."""
    where = directory()
    if where is None:
        return None
    path = where / f"{key}.{kind}"
    try:
        with open(path, "rb") as f:
            stored_format, value = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file is a miss, said once
        log.warning("tpudist: ignoring unreadable step cache entry %s: %s", path, exc)
        return None
    if stored_format != FORMAT:
        return None
    try:
        os.utime(path)  # used: the last to be pruned
    except OSError:
        pass
    return value


def store(kind: str, key: str, value: Any) -> None:
    """Writes the entry atomically (a concurrent reader sees all of it or none), then keeps the
    newest `KEEP` entries; a failure to write is logged, never raised (the step itself is fine)."""
    where = directory()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=f".{key[:16]}", delete=False) as f:
            pickle.dump((FORMAT, value), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(f.name, where / f"{key}.{kind}")
        _prune(where)
    except Exception as exc:  # noqa: BLE001
        log.warning("tpudist: could not write the step cache entry %s.%s in %s: %s", key, kind, where, exc)


KEEP = 1024  # entries (a step's two are ~40 KiB-1 MiB together); beyond it the least recently used go


def _prune(where: Path) -> None:
    entries = [e for e in os.scandir(where) if e.is_file() and not e.name.startswith(".")]
    if len(entries) <= KEEP:
        return
    entries.sort(key=lambda e: e.stat().st_mtime)
    for entry in entries[:len(entries) - KEEP]:
        try:
            os.remove(entry.path)
        except FileNotFoundError:  # another process pruned it
            pass


# -- capture entries ---------------------------------------------------------------------------------

def key_of(program: torch.export.ExportedProgram, switches: tuple) -> str | None:
    """`graph_key`, or None (logged) where the cache is off or cannot describe the graph."""
    if directory() is None:
        return None
    try:
        return graph_key(program, switches)
    except Uncacheable as exc:
        log.debug("tpudist: step cache: not caching this graph: it holds %s", exc)
        return None


def store_capture(key: str, captured: Any, exported: torch.export.ExportedProgram) -> None:
    """Keeps what the decomposition of `exported` told (`Captured.TOLD`); constants it created
    (absent before it) are kept by value."""
    told = {name: getattr(captured, name) for name in captured.TOLD}
    told["constants"] = {name: value.detach().cpu() for name, value in captured.constants.items()
                         if name not in exported.constants}
    captured.key = key
    store("capture", key, told)
