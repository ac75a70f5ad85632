"""Batches on the devices ahead of the step: `tpudist.device_loader` and `DeviceBatch`.

    for batch in tpudist.device_loader(loader):      # batch i + 1 moves while step i runs
        loss = step(batch)

A background thread iterates the loader and turns each batch into a `DeviceBatch`: every tensor
leaf a global array split over the mesh's "data" axis, this process's rows over its own devices,
exactly as the fused step would lay it out. The step then only launches its executable. Up to
`depth` batches wait ready; the thread stops when the iteration ends, is abandoned (the loop
breaks, the iterator is closed or collected) or the loader raises, whose error is raised in the
consuming loop with its own type and traceback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from tpudist.compile._torch._sync import leaf_key

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from tpudist.compile._torch._placement import Placement

_POLL_S = 0.5  # how often a waiting side re-checks that the other is still there


@dataclass(frozen=True)
class DeviceBatch:
    """One batch already on the devices, laid out for the fused step. `leaves` are the batch's
    leaves (tensors as global arrays split over "data", other leaves as they were), `spec` its
    structure, `keys` each original leaf's signature (shape, dtype), `rows` this process's rows."""

    leaves: list[Any]
    spec: TreeSpec
    keys: tuple
    rows: int

    def torch(self) -> Any:
        """The batch as torch tensors again (this process's rows; zero-copy on CPU)."""
        from tpudist.compile._torch._convert import to_torch
        out = []
        for leaf, key in zip(self.leaves, self.keys):
            if isinstance(leaf, jax.Array):
                blocks = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
                out.append(torch.cat([to_torch(b.data, key[1]) for b in blocks]))
            else:
                out.append(leaf)
        return tree_unflatten(out, self.spec)


def batch_rows(leaves: list[Any], parts: int, accumulate: int = 1) -> int:
    """This process's examples in a batch (every tensor leaf's leading size); ValueError naming
    the rank and the fix unless they agree and split into `parts` equal pieces."""
    rank = jax.process_index()
    shaped = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not shaped or any(t.ndim == 0 for t in shaped):
        raise ValueError(f"rank {rank}: every tensor of a batch needs a leading batch dimension; got shapes "
                         f"{[tuple(t.shape) for t in shaped]}")
    rows = {int(t.shape[0]) for t in shaped}
    if len(rows) != 1:
        raise ValueError(f"rank {rank}: the batch's tensors have different leading sizes {sorted(rows)}; "
                         "they must all be this process's examples")
    (n,) = rows
    if n == 0 or n % parts:
        devices = parts // accumulate
        split = f"{devices} devices" + (f" x {accumulate} micro-batches" if accumulate > 1 else "")
        raise ValueError(f"rank {rank}: a batch of {n} examples cannot be split evenly over this process's "
                         f"{split}; use a per-process batch size that is a multiple of {parts} "
                         "(e.g. DataLoader(drop_last=True))")
    return n


def to_device_batch(batch: Any, placement: "Placement", parts: int) -> DeviceBatch:
    """`batch` (any pytree of tensors / arrays with a leading batch dim) on the devices."""
    if isinstance(batch, DeviceBatch):
        return batch
    leaves, spec = tree_flatten(batch)
    leaves = [torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in leaves]
    rows = batch_rows(leaves, parts)
    keys = tuple(leaf_key(t) for t in leaves)
    arrays = [placement.put(t, split=True, copy=True) if isinstance(t, torch.Tensor) else t for t in leaves]
    return DeviceBatch(arrays, spec, keys, rows)


_DONE = object()


class _Prefetch(Iterator[DeviceBatch]):
    """The iterator `device_loader` returns. Its thread holds only the queue and the stop event,
    not the iterator, so an abandoned iterator is collected and its thread told to stop."""

    def __init__(self, batches: Iterable[Any], placement: "Placement", parts: int, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(iter(batches), placement, parts, self._queue,
                                                               self._stop),
                                        name="tpudist-device-loader", daemon=True)
        self._thread.start()

    def __next__(self) -> DeviceBatch:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("tpudist.device_loader: its thread ended without a batch or an error") from None
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stops the thread (it finishes the batch it is converting) and waits for it, at most 10 s."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)

    def __del__(self) -> None:
        self._stop.set()


def _produce(batches: Iterator[Any], placement: "Placement", parts: int, out: queue.Queue, stop: threading.Event) -> None:
    def offer(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in batches:
            if not offer(to_device_batch(batch, placement, parts)):
                return
    except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
        offer(error)
        return
    offer(_DONE)


def device_loader(loader: Iterable[Any], *, mesh: "Mesh | None" = None, depth: int = 2) -> Iterator[DeviceBatch]:
    """Iterates `loader` one step ahead: each batch is moved to the devices, laid out as the fused
    train step expects (its rows split over this process's devices), while the previous step runs.

    `mesh` must be the step's (default: every device on one "data" axis, the step's default);
    `depth` batches are prepared ahead at most. Pass the batches to `compile_train_step`'s step (or
    `tpudist.fit`, which does this itself). `DeviceBatch.torch()` gives a batch back as tensors.

        step = tpudist.compile_train_step(model, F.cross_entropy, opt)
        for batch in tpudist.device_loader(loader):
            loss = step(batch)
    """
    from tpudist.compile._torch._placement import AXIS, placement_for
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be a positive int")
    if mesh is None:
        from tpudist.mesh import make_mesh
        mesh = make_mesh({AXIS: -1})
    placement = placement_for(mesh)
    return _Prefetch(loader, placement, placement.local_count, depth)
