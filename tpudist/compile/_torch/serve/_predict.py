"""`tpudist.predict`: a loader's batches through a compiled model, split over the processes, every
output back on every process in loader order.

    outputs = tpudist.predict(model, loader)                 # [model(batch) for batch in loader]
    logits = tpudist.predict(model, loader, concat=True)     # the same, joined along dim 0

Each process runs batch i when i % process_count == its rank (as `fit` splits them, but a last,
partial round is run too), then the processes exchange what they computed: one all-gather of a
header (batches seen, examples, bytes), then the pickled outputs in fixed-size byte chunks, each an
all-gather of one shape (a few compiled collectives, whatever the outputs' shapes). A model laid out
over a mesh spanning several processes (`tpudist.parallelize`) is one SPMD program: every process
runs every batch and already holds every output.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from tpudist._runtime import process_count, process_index
from tpudist.collectives import all_gather
from tpudist.compile._torch.train import _fit_io
from tpudist.compile._torch.train._fit_report import examples_in
from tpudist.compile._torch.train._plan import call_model

__all__ = ["predict"]

_KEPT_ATTR = "_tpudist_predict"
# The outputs travel in chunks of a power of two bytes (one compiled all-gather per size), at least
# MIN_CHUNK; at most MAX_CHUNK, and at most GATHERED_MAX over all processes together, since each
# chunk's all-gather holds process_count chunks on the device at once.
MIN_CHUNK = 64 << 10
MAX_CHUNK = 64 << 20
GATHERED_MAX = 1 << 30


def predict(model: torch.nn.Module, loader: Iterable[Any], *, concat: bool = False, progress: bool | None = None,
            log: bool = True) -> Any:
    """Runs `model` on every batch of `loader` (eval mode, no grad, compiled by XLA); returns one
    output per batch, in loader order, on every process.

    Call it on every process with the same loader (same batches, same order: seed any shuffle
    identically). Under the launcher process r runs batch i when i % process_count == r, and every
    process then receives every output (unlike `fit`, a last round with fewer batches than
    processes is run too: every batch is predicted once). A model laid out with
    `tpudist.parallelize` over a mesh spanning several processes runs as one program: every process
    runs every batch with the others. A batch is called as `fit` calls it: `model(**batch)` for a
    dict (a Hugging Face model's `input_ids`, `attention_mask`), `model(*batch)` for a tuple or
    list, else `model(batch)`.

    The model runs through `tpudist.compile(model)` (kept per model: a second call compiles nothing
    new; each new batch shape compiles once), or is the `CompiledModule` given. It runs in eval mode
    under `torch.no_grad()`; each submodule's training mode is restored afterwards. Outputs are
    what the model returns (tensors, tuples, dicts, Hugging Face `ModelOutput`s), their tensors on
    the CPU. `concat=True` joins them along dim 0 instead: a tensor, or a tuple or dict of them (a
    `ModelOutput` becomes a dict). An empty loader returns [].

    Rank 0 shows progress (examples/s) as `fit` does (`progress`: True, False, or None for "where
    stderr or the launcher's console is a terminal") and, with `log`, one line at the end: examples,
    seconds, examples/s and how much of it was compiling. Example::

        logits = tpudist.predict(model, DataLoader(test_set, batch_size=64), concat=True)
        outputs = tpudist.predict(bert, hf_loader)            # [SequenceClassifierOutput, ...]
        labels = torch.cat([o.logits.argmax(-1) for o in outputs])
    """
    from tpudist.compile._torch.module._module import CompiledModule
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpudist.predict runs a torch.nn.Module; got {type(model).__name__}"
                        + (" (wrap the function in an nn.Module whose forward calls it)" if callable(model) else ""))
    compiled = model if isinstance(model, CompiledModule) else _compiled(model)
    module = compiled.module
    rank, count = process_index(), process_count()
    parts = 1 if count == 1 or _spans_processes(module) else count
    length = _checked_length(loader) if count > 1 else _length(loader)
    start = time.perf_counter()
    terminal = sys.stderr.isatty()
    bar = _fit_io.Progress(rank == 0 and _fit_io.shows_progress(progress, terminal), False, terminal)
    bar.start("predict", None if length is None else -(-(length - rank % parts) // parts))
    outputs: list[Any] = []
    seen = examples = 0
    compiling = 0.0  # the wall time of the calls that captured and compiled a new batch shape
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            for i, batch in enumerate(loader):
                seen += 1
                if i % parts != rank % parts:
                    continue
                if log and rank == 0 and not compiled.stats.calls:
                    print("predict: compiling the model (its first call; each new batch shape compiles once) ...",
                          file=sys.stderr, flush=True)
                compiles, called = compiled.stats.compiles, time.perf_counter()
                outputs.append(_on_host(call_model(compiled, batch)))
                if compiled.stats.compiles != compiles:
                    compiling += time.perf_counter() - called
                examples += examples_in(batch)
                busy = time.perf_counter() - start - compiling
                bar.update([], examples * parts / max(busy, 1e-9))
    finally:
        for m, training in modes:
            m.training = training
        bar.close()
    if parts > 1:
        outputs, examples = _exchange(outputs, seen, examples, rank, count)
    seconds = time.perf_counter() - start
    if log and rank == 0:
        of = f", of which compiling {compiling:.2f} s" if compiling else ""
        print(f"predict: {examples} examples in {seconds:.2f} s ({examples / max(seconds, 1e-9):,.0f} examples/s{of})",
              file=sys.stderr, flush=True)
    if concat and outputs:
        return _joined(outputs, "the output")
    return outputs


# -- the compiled module, kept per model ----------------------------------------------------------


class _Kept:
    """The CompiledModule predict made for a model, kept in the model's `__dict__`, so that it is
    collected with the model (a WeakKeyDictionary would keep every model alive: its value holds the
    model). A copy or a pickle of the model carries an empty one, and compiles afresh."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: Any = None):
        self.compiled = compiled

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Kept, ())


def _compiled(model: torch.nn.Module) -> Any:
    """`tpudist.compile(model)`, made once per model."""
    kept = model.__dict__.get(_KEPT_ATTR)
    if not isinstance(kept, _Kept) or kept.compiled is None:
        from tpudist.compile._torch.module._module import compile_module
        kept = model.__dict__[_KEPT_ATTR] = _Kept(compile_module(model))
    return kept.compiled


def _spans_processes(module: torch.nn.Module) -> bool:
    """Whether `module` is laid out (tpudist.parallelize) over a mesh with devices of several
    processes: its compiled calls are one program that every process runs together."""
    from tpudist.compile._torch._layout import layout
    laid_out = layout(module)
    return laid_out is not None and len({d.process_index for d in laid_out.mesh.devices.flat}) > 1


# -- the loader -----------------------------------------------------------------------------------


def _length(loader: Iterable[Any]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _checked_length(loader: Iterable[Any]) -> int | None:
    """The loader's length (None without len); ValueError where processes differ (one collective)."""
    length = _length(loader)
    if length is None:
        return None
    lengths = all_gather(np.array([length], np.int64)).tolist()
    if len(set(lengths)) > 1:
        raise ValueError(f"predict: the loaders have different lengths on different processes ({lengths}, by rank); "
                         "give every process the same loader (same batches, same order: seed any shuffle "
                         "identically); predict splits its batches over the processes itself")
    return length


def _on_host(output: Any) -> Any:
    """`output` with each tensor detached and on the CPU (the structure kept)."""
    return torch.utils._pytree.tree_map(
        lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf, output)


# -- the exchange ---------------------------------------------------------------------------------


def _exchange(mine: list[Any], seen: int, examples: int, rank: int, count: int) -> tuple[list[Any], int]:
    """Every process's outputs, in loader order (batch i from process i % count), and the examples
    of all processes. Outputs travel pickled (the processes are one job: their bytes are trusted)."""
    payload = _pickled(mine) if mine else np.zeros(0, np.uint8)
    header = np.asarray(all_gather(np.array([seen, examples, payload.size], np.int64))).reshape(count, 3)
    seens = header[:, 0].tolist()
    if len(set(seens)) > 1:
        raise ValueError(f"predict: the loaders gave different numbers of batches on different processes ({seens}, "
                         "by rank); give every process the same loader (same batches, same order: seed any "
                         "shuffle identically)")
    sizes = header[:, 2].tolist()
    received = [np.empty(size, np.uint8) for size in sizes]
    chunk = _chunk_bytes(max(sizes), count)
    for first in range(0, max(sizes), chunk):
        block = np.zeros(chunk, np.uint8)
        piece = payload[first:first + chunk]
        block[:piece.size] = piece
        gathered = np.asarray(all_gather(block)).reshape(count, chunk)
        for r, size in enumerate(sizes):
            n = min(chunk, size - first)
            if n > 0 and r != rank:
                received[r][first:first + n] = gathered[r, :n]
    per_rank = [mine if r == rank else _unpickled(received[r]) if sizes[r] else [] for r in range(count)]
    for r, outputs in enumerate(per_rank):
        assert len(outputs) == len(range(r, seens[0], count)), (r, len(outputs), seens[0])
    return [per_rank[i % count][i // count] for i in range(seens[0])], int(header[:, 1].sum())


def _chunk_bytes(largest: int, count: int) -> int:
    limit = max(MIN_CHUNK, min(MAX_CHUNK, 1 << ((GATHERED_MAX // count).bit_length() - 1)))
    return min(limit, max(MIN_CHUNK, 1 << max(largest - 1, 0).bit_length()))


def _pickled(outputs: list[Any]) -> np.ndarray:
    buffer = io.BytesIO()
    torch.save(outputs, buffer)
    return np.frombuffer(buffer.getbuffer(), np.uint8)


def _unpickled(data: np.ndarray) -> list[Any]:
    # weights_only=False: outputs may be any class the model returns (a Hugging Face ModelOutput)
    return torch.load(io.BytesIO(data.tobytes()), weights_only=False)


# -- concat=True ----------------------------------------------------------------------------------


def _joined(values: list[Any], where: str) -> Any:
    """The batches' outputs `values` (one structure) joined along dim 0; `where` names them in errors."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        odd = next((i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)), None)
        if odd is not None:
            raise TypeError(f"predict(concat=True): {where} is a tensor in batch 0 but a {type(values[odd]).__name__} "
                            f"in batch {odd}; pass concat=False")
        if first.ndim == 0:
            raise ValueError(f"predict(concat=True): {where} is a 0-d tensor (one value per batch), with no dim 0 to "
                             "join along; pass concat=False")
        other = next((i for i, v in enumerate(values) if v.ndim == 0 or v.shape[1:] != first.shape[1:]), None)
        if other is not None:
            raise ValueError(f"predict(concat=True): {where} has shape {tuple(first.shape)} in batch 0 and "
                             f"{tuple(values[other].shape)} in batch {other}: they differ beyond dim 0; pad the "
                             "batches to one size or pass concat=False")
        return torch.cat(values)
    if isinstance(first, Mapping):  # a dict, or a Hugging Face ModelOutput (its fields that are set)
        keys = list(first.keys())
        for i, v in enumerate(values):
            if not isinstance(v, Mapping) or list(v.keys()) != keys:
                raise ValueError(f"predict(concat=True): {where} has keys {keys} in batch 0 but "
                                 f"{list(v.keys()) if isinstance(v, Mapping) else type(v).__name__} in batch {i}; "
                                 "pass concat=False")
        return {k: _joined([v[k] for v in values], f"{where}[{k!r}]") for k in keys}
    if isinstance(first, (tuple, list)):
        for i, v in enumerate(values):
            if not isinstance(v, (tuple, list)) or len(v) != len(first):
                raise ValueError(f"predict(concat=True): {where} has {len(first)} elements in batch 0 but "
                                 f"{len(v) if isinstance(v, (tuple, list)) else type(v).__name__} in batch {i}; "
                                 "pass concat=False")
        joined = [_joined([v[j] for v in values], f"{where}[{j}]") for j in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    if all(v is None for v in values):
        return None
    raise TypeError(f"predict(concat=True) joins tensors; {where} is a {type(first).__name__}; pass concat=False")
