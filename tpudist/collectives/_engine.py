"""The collective engine: one XLA executable per collective signature, run on one device per process.

Every process contributes one block (its value) on its first local device. The participating
devices form a (group, slot) mesh: row g holds the processes of replica group g, so a collective
over the "slot" axis runs inside each group and every process gets its own group's result. One
executable is compiled per signature (collective, parameters, groups, shapes, dtypes) and cached.

Mismatches and missing peers become errors rather than hangs:
- the first time a process sees a signature, it publishes it in the coordinator's key-value store
  and compares it with every peer's at the same position in the sequence of collectives;
- XLA's gloo collectives time out after TPUDIST_COLLECTIVE_TIMEOUT seconds (init() passes it as
  --xla_cpu_collective_timeout_seconds); a process that timed out records its arrival in the
  key-value store and reads its peers', so the message names the ranks that never came.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpudist import _runtime, contract
from tpudist._jaxcompat import assemble  # tpudist.compile imports it from here
from tpudist.collectives import _convert

log = logging.getLogger("tpudist.collectives")

SLOT = "s"  # mesh axis inside a replica group
GROUP = "g"  # mesh axis across replica groups
_SPEC = P(GROUP, SLOT)
_ARRIVAL_GRACE = 2.0  # seconds a timed-out process gives its peers to record their arrival


class CollectiveError(RuntimeError):
    """A collective that cannot run: peers disagree, or an earlier collective failed."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """Peers did not reach a collective within the deadline."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective call: its name and parameters, and the function its executable runs.

    `body(blocks, slots)` gets every leaf's local block, shaped (1, 1, *shape), inside a
    shard_map over the (group, slot) mesh, where `slots` is the group size; it returns one block
    per leaf.
    """

    name: str
    params: tuple[tuple[str, Any], ...]
    body: Callable[[list[jax.Array], int], list[jax.Array]]
    detail: tuple[tuple[str, Any], ...] = ()  # compared with peers, not part of the cache key


def normalize_groups(groups: Sequence[Sequence[int]] | None, n: int) -> tuple[tuple[int, ...], ...]:
    """Validates torch_xla-style replica groups; None means one group of every process."""
    if groups is None:
        return (tuple(range(n)),)
    try:
        norm = tuple(tuple(int(r) for r in g) for g in groups)
    except TypeError:
        raise TypeError(f"groups={groups!r} must be a list of lists of process indices, "
                        "such as [[0, 1], [2, 3]]") from None
    sizes = {len(g) for g in norm}
    if not norm or 0 in sizes:
        raise ValueError(f"groups={groups!r} must be non-empty lists of process indices")
    if len(sizes) != 1:
        raise ValueError(f"groups={groups!r} have different sizes {sorted(sizes)}; every replica "
                         "group must have the same number of processes")
    members = [r for g in norm for r in g]
    if sorted(members) != list(range(n)):
        dup = sorted({r for r in members if members.count(r) > 1})
        missing = sorted(set(range(n)) - set(members))
        extra = sorted({r for r in members if not 0 <= r < n})
        why = "; ".join(s for s in (
            f"{dup} appear more than once" if dup else "",
            f"{missing} are in no group" if missing else "",
            f"{extra} are not process indices (0..{n - 1})" if extra else "") if s)
        raise ValueError(f"groups={groups!r} must partition the {n} processes of the job: {why}")
    return norm


class Engine:
    """Compiles, checks and runs collectives for this process. One per job (see `engine()`)."""

    def __init__(self) -> None:
        job = _runtime.job()
        self.rank, self.n = job.rank, job.world_size
        self.host = job.host or socket.gethostname()
        self.timeout = job.collective_timeout
        self.kv = _runtime.kv_client()
        self.prefix = f"tpudist/{job.job_id or 'job'}/c"
        self.device = jax.local_devices()[0]
        first: dict[int, Any] = {}
        for d in sorted(jax.devices(), key=lambda d: d.id):
            first.setdefault(d.process_index, d)
        self.process_devices = [first[p] for p in range(self.n)]
        self.seq = 0
        self.stats = {"compiles": 0, "calls": 0, "compile_seconds": 0.0}
        self._cache: dict[Any, Any] = {}
        self._shardings: dict[Any, NamedSharding] = {}
        self._stagings: dict[Any, _Staging | None] = {}
        self.quick: dict[Any, Callable[[Any], Any] | None] = {}  # the collectives' repeat paths (_ops)
        self._lock = threading.Lock()
        self._broken: str | None = None

    # -- public entry ---------------------------------------------------------------------------

    def run(self, op: Op, groups: tuple[tuple[int, ...], ...],
            blocks: list[jax.Array] | list[np.ndarray]) -> list[jax.Array]:
        """Runs `op` on this process's blocks; returns this process's result blocks.

        Blocks given as host arrays (small values) are copied into the signature's staging
        buffers (`_Staging`) instead of being imported afresh.
        """
        with self._lock:
            seq = self._next_seq()
            limit = self.timeout
            deadline = time.monotonic() + limit
            sharding = self._sharding(groups)
            key = self._key(op, groups, blocks)
            compiled = self._cache.get(key)
            if compiled is None:
                if self.kv is not None:
                    self._check_peers(seq, op, groups, blocks, deadline, limit)
                compiled = self._compile(op, groups, blocks)
                self._cache[key] = compiled
            if isinstance(blocks[0], np.ndarray):
                inputs = self._staged(key, sharding, groups, blocks)
            else:
                inputs = [_global_array(sharding, groups, b) for b in blocks]
            return self._execute(op, seq, compiled, inputs)

    def repeat(self, op: Op, groups: tuple[tuple[int, ...], ...],
               blocks: list[np.ndarray]) -> tuple[Callable[[Callable[[], Any]], list[jax.Array]],
                                                  list[np.ndarray]] | None:
        """For a signature `run` has already served through staging buffers: `(call, hosts)`, where
        `call(fill)` runs it again after `fill()` has written the values into `hosts` (the staging
        arrays, shaped like `blocks`), skipping the lookups. None when there is no such staging.

        Peers were checked when the signature was new; every call still takes a sequence number,
        the lock and the deadline, like `run`.
        """
        key = self._key(op, groups, blocks)
        compiled, staging = self._cache.get(key), self._stagings.get(key)
        if compiled is None or not staging:
            return None

        def call(fill: Callable[[], Any]) -> list[jax.Array]:
            with self._lock:
                seq = self._next_seq()
                fill()
                return self._execute(op, seq, compiled, staging.inputs)
        return call, staging.hosts

    # -- pieces ---------------------------------------------------------------------------------

    @staticmethod
    def _key(op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[Any]) -> Any:
        return op.name, op.params, groups, tuple((b.shape, np.dtype(b.dtype)) for b in blocks)

    def _next_seq(self) -> int:
        if self._broken:
            raise CollectiveError(f"rank {self.rank} on {self.host}: collectives are unusable "
                                  f"after an earlier failure ({self._broken}); restart the job")
        self.seq += 1
        return self.seq

    def _execute(self, op: Op, seq: int, compiled: Any, inputs: list[jax.Array]) -> list[jax.Array]:
        """Runs `compiled` on `inputs` (lock held); turns failures into the job's errors."""
        self.stats["calls"] += 1
        limit = self.timeout
        start = time.monotonic()
        try:
            # XLA's gloo collectives enforce the deadline themselves (init() sets
            # --xla_cpu_collective_timeout_seconds); small ones even run inside this call.
            outs = [o.addressable_data(0) for o in compiled(*inputs)]
            jax.block_until_ready(outs)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError, re-raised with the job's facts
            self._broken = f"{op.name} (collective #{seq}) failed"
            if time.monotonic() - start >= 0.9 * limit or "timed out" in str(e).lower():
                missing = self._missing(seq) if self.kv is not None else []
                raise self._timeout_error(seq, op, missing, "waiting for peers", limit) from e
            raise CollectiveError(f"rank {self.rank} on {self.host}: {op.name} (collective #{seq}) "
                                  f"failed, most likely because a peer process died: {e}") from e
        return outs

    def _staged(self, key: Any, sharding: NamedSharding, groups: tuple[tuple[int, ...], ...],
                hosts: list[np.ndarray]) -> list[jax.Array]:
        """The global inputs holding `hosts`' values: the signature's staging buffers, refilled,
        or (where a buffer cannot be shared with XLA) freshly imported blocks."""
        staging = self._stagings.get(key)
        if staging is None:
            staging = self._stagings[key] = _Staging.build(hosts, sharding, groups, self.device)
        if staging:
            return staging.fill(hosts)
        inputs = []
        for host in hosts:
            block = _convert.import_buffer(host, self.device)
            if block is None:
                block = jax.device_put(host, self.device)
            inputs.append(_global_array(sharding, groups, block))
        return inputs

    def _sharding(self, groups: tuple[tuple[int, ...], ...]) -> NamedSharding:
        """The (group, slot) sharding over one device per process, built once per grouping."""
        found = self._shardings.get(groups)
        if found is None:
            devices = np.array([[self.process_devices[r] for r in g] for g in groups])
            found = self._shardings[groups] = NamedSharding(Mesh(devices, (GROUP, SLOT)), _SPEC)
        return found

    def _compile(self, op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[jax.Array]) -> Any:
        sharding = self._sharding(groups)
        mesh = sharding.mesh
        slots = mesh.shape[SLOT]
        lead = (mesh.shape[GROUP], slots)
        avals = [jax.ShapeDtypeStruct(lead + b.shape[2:], b.dtype, sharding=sharding) for b in blocks]
        fn = jax.shard_map(lambda *xs: list(op.body(list(xs), slots)), mesh=mesh,
                           in_specs=tuple(_SPEC for _ in blocks), out_specs=[_SPEC] * len(blocks))
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*avals).compile()
        seconds = time.perf_counter() - start
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += seconds
        log.debug("compiled %s%s for %s in %.3fs", op.name, dict(op.params), [a.shape for a in avals], seconds)
        return compiled

    def _signature(self, op: Op, groups: Any, blocks: list[jax.Array]) -> dict[str, Any]:
        return {
            "collective": op.name,
            **{k: repr(v) for k, v in op.params},
            "groups": [list(g) for g in groups],
            "number of values": len(blocks),
            **dict(op.detail),
            "shapes": [list(b.shape[2:]) for b in blocks],
            "dtypes": [str(b.dtype) for b in blocks],
        }

    def _check_peers(self, seq: int, op: Op, groups: Any, blocks: list[jax.Array], deadline: float,
                     limit: float) -> None:
        mine = self._signature(op, groups, blocks)
        base = f"{self.prefix}/sig/{seq}/"
        self.kv.key_value_set(base + str(self.rank), json.dumps(mine))
        for r in range(self.n):
            if r == self.rank:
                continue
            left_ms = int(max(1.0, (deadline - time.monotonic()) * 1000))
            try:
                theirs = json.loads(self.kv.blocking_key_value_get(base + str(r), left_ms))
            except Exception:  # noqa: BLE001 - the coordination service's timeout error
                missing = self._absent(base)
                self._broken = f"{op.name} (collective #{seq}) timed out"  # sequence now out of step
                raise self._timeout_error(seq, op, missing, "checking the collective's signature",
                                          limit) from None
            for field, value in mine.items():
                if theirs.get(field) != value:
                    raise CollectiveError(
                        f"rank {self.rank} on {self.host}: {op.name} (collective #{seq}) {field} "
                        f"{_show(value)} differs from rank {r}'s {_show(theirs.get(field))}; every "
                        "process must call the same collectives in the same order with the same "
                        "shapes, dtypes and parameters")

    def _absent(self, base: str) -> list[int]:
        """The other ranks with no key under `base` in the key-value store."""
        return [r for r in range(self.n) if r != self.rank and not self._has(base + str(r))]

    def _has(self, key: str) -> bool:
        try:
            return self.kv.key_value_try_get(key) is not None
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return False

    def _arrive(self, seq: int) -> None:
        try:
            self.kv.key_value_set(f"{self.prefix}/arrive/{seq}/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - best effort; only improves the timeout message
            pass

    def _missing(self, seq: int) -> list[int]:
        self._arrive(seq)
        time.sleep(_ARRIVAL_GRACE)  # peers that are also waiting time out about now and record theirs
        return self._absent(f"{self.prefix}/arrive/{seq}/")

    def _timeout_error(self, seq: int, op: Op, missing: list[int], doing: str,
                       limit: float) -> CollectiveTimeout:
        who = f"ranks {missing} did not arrive" if missing else "peers did not finish"
        return CollectiveTimeout(
            f"rank {self.rank} on {self.host}: {op.name} (collective #{seq}) timed out after "
            f"{limit:g}s {doing}: {who} (crashed, stuck, or called a different collective). "
            f"Raise {contract.COLLECTIVE_TIMEOUT} if steps are slow.")

    def barrier(self, timeout: float | None = None) -> None:
        """Waits until every process reaches this barrier, or raises CollectiveTimeout."""
        with self._lock:
            self.seq += 1
            if self.kv is None:
                return
            seq, limit = self.seq, timeout or self.timeout
            self._arrive(seq)
            try:
                self.kv.wait_at_barrier(f"{self.prefix}/barrier/{seq}", int(limit * 1000))
            except Exception:  # noqa: BLE001 - the coordination service's timeout error
                missing = self._absent(f"{self.prefix}/arrive/{seq}/")
                raise self._timeout_error(seq, Op("barrier", (), lambda b, s: b), missing,
                                          "at the barrier", limit) from None


class _Staging:
    """Reused input buffers for the small values of one signature.

    A synchronous collective on a freshly imported buffer takes ~0.2-0.3 ms longer than on one XLA
    has already run on (2 processes, a 4-byte all_reduce: 0.56-0.66 ms against 0.37 ms, gloo
    0.28 ms; docs/collectives.md). So each signature keeps 64-byte-aligned host arrays, shared with
    XLA once without a copy, and every call copies its values in. The engine's lock serializes
    calls and each call waits for its results, so XLA has read a buffer before the next call
    writes it; the buffers never leave the engine.
    """

    def __init__(self, hosts: list[np.ndarray], inputs: list[jax.Array]) -> None:
        self.hosts, self.inputs = hosts, inputs

    @classmethod
    def build(cls, like: list[np.ndarray], sharding: NamedSharding, groups: tuple[tuple[int, ...], ...],
              device: Any) -> _Staging | None:
        """Staging for values shaped like `like`, or None where XLA would not share a buffer
        (empty values, dtypes DLPack cannot carry such as numpy's bfloat16, another jaxlib)."""
        hosts, inputs = [], []
        for value in like:
            host = _aligned(value.shape, value.dtype)
            block = _convert.import_buffer(host, device) if host.nbytes else None
            if block is None or block.unsafe_buffer_pointer() != host.ctypes.data:
                return None
            hosts.append(host)
            inputs.append(_global_array(sharding, groups, block))
        return cls(hosts, inputs)

    def fill(self, values: list[np.ndarray]) -> list[jax.Array]:
        for host, value in zip(self.hosts, values):
            np.copyto(host, value)
        return self.inputs


def _aligned(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized host array whose data starts on an `alignment`-byte boundary (XLA:CPU
    shares aligned buffers and copies others)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _global_array(sharding: NamedSharding, groups: tuple[tuple[int, ...], ...], block: jax.Array) -> jax.Array:
    """The (groups, slots, *shape) global array of which `block` is this process's only shard."""
    return assemble((len(groups), len(groups[0])) + block.shape[2:], sharding, [block])


def _show(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return ", ".join(str(tuple(v)) for v in value)
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """This process's engine, created on first use (joining the job if needed)."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine()
    return _engine


def reset() -> None:
    """Drops the engine (at shutdown): its executables belong to the runtime being closed."""
    global _engine
    _engine = None
