"""Checksums of every file of a step: written before its commit, checked before a restore reads it.

orbax-checkpoint (0.12) checksums none of the array data it writes (TensorStore's crc32c covers
only a zarr3 shard's index, and orbax has no option for more), so a flipped byte inside a data
file reads back as a wrong value. tpudist adds one small file per step, `<step>/default/_CHECKSUMS`
(JSON: every file's size and CRC32), written before the step is committed:

- each process, once its own writes are durable and before orbax's `async_write_complete`
  barrier, checksums its own store `ocdbt.process_<i>/` into `_CHECKSUMS.parts/process_<i>.json`
  (it reads back only what it wrote, from its page cache);
- process 0, after orbax's finalize (the OCDBT merge) and before the rename that commits the step,
  checksums every file no part covers (the tree metadata, the merged OCDBT root) and writes the
  union as `_CHECKSUMS`.

A step without `_CHECKSUMS` was written by plain orbax or an older tpudist: it is read unverified.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

log = logging.getLogger("tpudist.checkpoint")

MANIFEST = "_CHECKSUMS"
_PARTS = "_CHECKSUMS.parts"
_BLOCK = 8 << 20

Manifest = dict[str, tuple[int, int]]  # file (relative to the item directory) -> (size, CRC32)


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _files(root: str, under: str = "") -> list[str]:
    """Every file below `root/under`, relative to root (none when it does not exist)."""
    found = []
    for dirpath, _, names in os.walk(os.path.join(root, under)):
        for name in names:
            found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def _checksums(root: str, names: list[str]) -> Manifest:
    return {n: (os.path.getsize(os.path.join(root, n)), crc32(os.path.join(root, n))) for n in names}


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


class _AfterWrites:
    """An orbax commit future: once this process's writes (`futures`) are done, checksums its own
    store into its part of the manifest. Orbax waits on it in its background thread, before the
    barrier that precedes the commit."""

    def __init__(self, futures: list[Any], item: str, on_failure: Callable[[BaseException], None] | None):
        self._futures, self._item, self._on_failure = futures, item, on_failure

    def result(self, timeout: float | None = None) -> None:
        try:
            self._write(timeout)
        except Exception as e:  # noqa: BLE001 - told to the peers waiting at the barrier, then re-raised
            if self._on_failure is not None:
                self._on_failure(e)
            raise

    def _write(self, timeout: float | None) -> None:
        for f in self._futures:
            f.result(timeout=timeout)
        rank = jax.process_index()
        part = _checksums(self._item, _files(self._item, f"ocdbt.process_{rank}"))
        os.makedirs(os.path.join(self._item, _PARTS), exist_ok=True)
        _write_json(os.path.join(self._item, _PARTS, f"process_{rank}.json"),
                    {n: list(v) for n, v in part.items()})

    def cancel(self) -> bool:
        return False


class ChecksummingHandler(ocp.PyTreeCheckpointHandler):
    """orbax's PyTree handler, plus `_CHECKSUMS` written before the commit. `on_failure(error)` is
    called (in orbax's background thread) when this process's writes fail."""

    def __init__(self, *args: Any, on_failure: Callable[[BaseException], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_failure = on_failure

    async def async_save(self, directory: Any, *args: Any, **kwargs: Any) -> list[Any]:
        futures = list(await super().async_save(directory, *args, **kwargs) or [])
        item = os.fspath(getattr(directory, "path", directory))
        # one future that waits for the writes first: a failed write reaches `on_failure`
        return [_AfterWrites(futures, item, self._on_failure)]

    def finalize(self, directory: Any) -> None:
        super().finalize(directory)  # on process 0 only, after every process's writes
        item = os.fspath(directory)
        parts_dir = os.path.join(item, _PARTS)
        manifest: Manifest = {}
        for rank in range(jax.process_count()):
            part = os.path.join(parts_dir, f"process_{rank}.json")
            if not os.path.exists(part):
                raise OSError(f"process {rank} wrote no checksums ({part} is missing)")
            with open(part) as f:
                manifest.update({n: (int(s), int(c)) for n, (s, c) in json.load(f).items()})
        shutil.rmtree(parts_dir)
        rest = [n for n in _files(item) if n not in manifest and n != MANIFEST]
        manifest.update(_checksums(item, rest))
        _write_json(os.path.join(item, MANIFEST),
                    {"algorithm": "crc32", "files": {n: list(v) for n, v in sorted(manifest.items())}})


def read_manifest(item: str) -> Manifest | None:
    """The step's checksums, or None for a step written without them. Raises ValueError for an
    unreadable `_CHECKSUMS`."""
    path = os.path.join(item, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        return {n: (int(s), int(c)) for n, (s, c) in files.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"its checksum file {path} is truncated or corrupt ({type(e).__name__}: {e})") from e


def check_file(item: str, name: str, size: int, crc: int) -> str | None:
    """What is wrong with one file of the step, or None when it is as written."""
    path = os.path.join(item, name)
    try:
        have = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path} is missing"
    if have < size:
        return f"{path} is truncated: {have} bytes of the {size} written"
    if have > size:
        return f"{path} is {have} bytes, longer than the {size} written"
    got = crc32(path)
    if got != crc:
        return (f"{path} does not match its checksum (CRC32 {got:08x}, written {crc:08x}): its "
                "bytes changed after the save")
    return None


def share(manifest: Manifest, rank: int, world: int) -> list[str]:
    """The files process `rank` of `world` verifies: each file once in the job, the bytes spread
    evenly (largest first, each to the process with the fewest bytes so far)."""
    load, mine = [0] * world, []
    for name, (size, _) in sorted(manifest.items(), key=lambda kv: (-kv[1][0], kv[0])):
        who = min(range(world), key=lambda r: (load[r], r))
        load[who] += size
        if who == rank:
            mine.append(name)
    return mine


def verify(item: str, rank: int = 0, world: int = 1,
           on_unverified: Callable[[], None] | None = None) -> str | None:
    """The first problem in this process's share of the step's files, or None. A step written
    without checksums calls `on_unverified` and counts as fine."""
    manifest = read_manifest(item)
    if manifest is None:
        if on_unverified is not None:
            on_unverified()
        return None
    for name in share(manifest, rank, world):
        problem = check_file(item, name, *manifest[name])
        if problem:
            return problem
    return None
