"""The collective engine: one XLA executable per collective signature, run on one device per process.

Every process contributes one block (its value) on its first local device. The participating
devices form a (group, slot) mesh: row g holds the processes of replica group g, so a collective
over the "slot" axis runs inside each group and every process gets its own group's result. Each
signature (collective, parameters, groups, shapes, dtypes) is compiled the first time a process
meets it and kept as one record (`_Signature`): its executable, its inputs' sharding and its
staging buffers.

Peers agree on every call, cached signatures included, inside the same executable: each process
brings a header (its rank, the call's sequence number and a fingerprint of the call's signature,
pytree structure included) that the executable all-gathers before anything else, and the
collective's exchanges of data run only where every header agrees (`lax.cond`,
`_lax.guarded`); otherwise every process gets
the table of headers back and raises a CollectiveError naming both sides (`_peers.Peers.mismatch`).
Executables of different signatures all start with the same header exchange, so processes that
called different collectives still meet there instead of mixing float bits with int bits or
aborting in gloo.

One engine serves one job: `engine()` builds a new one when the process has joined another job
(`tpudist.shutdown()` then `tpudist.init()`), since the old one's executables, devices and
key-value store belong to the job that ended.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpudist import _profile, _runtime, _stacks, contract
from tpudist._buffers import HostBuffers, aligned, share
from tpudist._jaxcompat import assemble, import_buffer
from tpudist.collectives._agree import GROUP, HEADER, SLOT, Check, agreed, fingerprint
from tpudist.collectives._peers import CollectiveError, CollectiveTimeout, Peers

log = logging.getLogger("tpudist.collectives")

_SPEC = P(GROUP, SLOT)

@dataclasses.dataclass
class CollectiveStats:
    """Counts of this process's eager collectives in the current job (see `collective_stats()`).

    `compiles`: executables built, one per signature (collective, parameters, groups, shapes,
    dtypes) the first time the process meets it; `compile_seconds`: the time they took; `calls`:
    collectives run. A loop that repeats the same collectives shows `compiles` stop growing after
    its first iteration while `calls` keeps counting.
    """

    compiles: int = 0
    compile_seconds: float = 0.0
    calls: int = 0


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
    """Compiles, checks and runs collectives for this process in one job (see `engine()`)."""

    def __init__(self, job: contract.JobEnv) -> None:
        self.job = job
        self.rank, self.n = job.rank, job.world_size
        self.peers = Peers(_runtime.kv_client(), f"tpudist/{job.job_id or 'job'}/c", job.rank,
                           job.world_size, job.host or socket.gethostname(), job.collective_timeout)
        self.device = jax.local_devices()[0]
        first: dict[int, Any] = {}
        for d in sorted(jax.devices(), key=lambda d: d.id):
            first.setdefault(d.process_index, d)
        self.process_devices = [first[p] for p in range(self.n)]
        self.seq = 0
        self.stats = CollectiveStats()
        self._signatures: dict[Any, _Signature] = {}
        # replica-group layouts this process has agreed on with its peers (one group of all: none needed)
        self._layouts: set[tuple[tuple[int, ...], ...]] = {(tuple(range(self.n)),)}
        self._lock = threading.Lock()
        self._broken: str | None = None

    def run(self, op: Op, groups: tuple[tuple[int, ...], ...],
            blocks: list[jax.Array] | list[np.ndarray]) -> list[jax.Array]:
        """Runs `op` on this process's blocks; returns this process's result blocks.

        Blocks given as host arrays (small values) are copied into the signature's staging
        buffers (`_buffers.HostBuffers`) instead of being imported afresh.
        """
        with self._lock:
            seq = self._next_seq()
            if groups not in self._layouts:  # a layout new to this process: its peers' must match
                try:
                    self.peers.agree_groups(seq, op.name, groups)
                except CollectiveTimeout:  # peers went on without this call: out of step, as after any timeout
                    self._broken = f"{op.name} (collective #{seq}) timed out"
                    raise
                self._layouts.add(groups)
            key = _key(op, groups, blocks)
            signature = self._signatures.get(key)
            if signature is None:
                with _profile.span(f"tpudist.compile_collective[{op.name}]"):
                    signature = self._signatures[key] = self._compile(op, groups, blocks)
            check = Check(op, groups, blocks, fingerprint(key, op.detail))
            return self._execute(check, seq, signature, signature.inputs(blocks, self.device))

    def repeat(self, op: Op, groups: tuple[tuple[int, ...], ...],
               blocks: list[np.ndarray]) -> tuple[Callable[[Callable[[], Any]], list[jax.Array]],
                                                  list[np.ndarray]] | None:
        """For a signature `run` has already served through staging buffers: `(call, hosts)`, where
        `call(fill)` runs it again after `fill()` has written the values into `hosts` (the staging
        arrays, shaped like `blocks`), skipping the lookups. None when there is no such staging.

        Every call still takes a sequence number and the lock, and its peers' agreement is
        checked in the executable, like `run`.
        """
        key = _key(op, groups, blocks)
        signature = self._signatures.get(key)
        staging = signature.staging if signature is not None else None
        if staging is None:
            return None
        check = Check(op, groups, blocks, fingerprint(key, op.detail))

        def call(fill: Callable[[], Any]) -> list[jax.Array]:
            with self._lock:
                seq = self._next_seq()
                fill()
                return self._execute(check, seq, signature, staging.arrays)
        return call, staging.hosts

    def barrier(self, timeout: float | None = None) -> None:
        """Waits until every process reaches this barrier, or raises CollectiveTimeout."""
        with self._lock:
            self.seq += 1
            _stacks.entered("barrier")
            self.peers.barrier(self.seq, timeout)

    def _next_seq(self) -> int:
        if self._broken:
            raise CollectiveError(f"{self.peers.me}: collectives are unusable after an earlier "
                                  f"failure ({self._broken}); restart the job")
        self.seq += 1
        return self.seq

    def _execute(self, check: Check, seq: int, signature: _Signature,
                 inputs: list[jax.Array]) -> list[jax.Array]:
        """Runs `signature`'s executable on `inputs` (lock held) after the header exchange;
        turns failures and disagreements into the job's errors."""
        name = check.op.name
        self.stats.calls += 1
        _stacks.entered(name)  # the hang report's "last collective"; a shared-memory write
        start = time.monotonic()
        try:
            # XLA's gloo collectives enforce the deadline themselves (init() sets
            # --xla_cpu_collective_timeout_seconds); small ones even run inside this call.
            if signature.header is None:
                outs = [o.addressable_data(0) for o in signature.executable(*inputs)]
            else:
                header = signature.header.fill(self.rank, seq, check.fingerprint)
                table, *outs = [o.addressable_data(0) for o in signature.executable(header, *inputs)]
            jax.block_until_ready(outs)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError, re-raised with the job's facts
            self._broken = f"{name} (collective #{seq}) failed"
            raise self.peers.failure(seq, name, e, time.monotonic() - start, check.groups) from e
        if signature.header is not None:
            rows = np.asarray(table).reshape(-1, HEADER)
            if (rows[:, 1:] != rows[0, 1:]).any():
                raise self.peers.mismatch(seq, name, rows, _described(check.op, check.groups, check.blocks),
                                          time.monotonic() + self.peers.timeout)
        return outs

    def _compile(self, op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[Any]) -> _Signature:
        devices = np.array([[self.process_devices[r] for r in g] for g in groups])
        sharding = NamedSharding(Mesh(devices, (GROUP, SLOT)), _SPEC)
        lead = devices.shape
        avals = [jax.ShapeDtypeStruct(lead + b.shape[2:], b.dtype, sharding=sharding) for b in blocks]
        checked = self.n > 1  # a single process has no peer to disagree with
        if checked:
            avals.insert(0, jax.ShapeDtypeStruct(lead + (HEADER,), np.int32, sharding=sharding))
            body = agreed(op, lead, self.device.platform, blocks)
        else:
            body = lambda *xs: list(op.body(list(xs), lead[1]))  # noqa: E731
        # check_vma=False where checked: JAX's varying-axes check rejects the collectives' own
        # bodies vmapped over the slot axis (`_from_everyone`), which are per-process arithmetic there.
        fn = jax.shard_map(body, mesh=sharding.mesh, in_specs=tuple(_SPEC for _ in avals),
                           out_specs=[_SPEC] * len(avals), check_vma=not checked)
        start = time.perf_counter()
        executable = jax.jit(fn).lower(*avals).compile()
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.compile_seconds += seconds
        log.debug("compiled %s%s for %s in %.3fs", op.name, dict(op.params), [a.shape for a in avals], seconds)
        signature = _Signature(executable, sharding, lead)
        if checked:
            signature.header = _Header.build(signature, self.device)
        return signature


def _key(op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[Any]) -> Any:
    return op.name, op.params, groups, tuple((b.shape, np.dtype(b.dtype)) for b in blocks)


def _described(op: Op, groups: tuple[tuple[int, ...], ...], blocks: list[Any]) -> dict[str, Any]:
    """The signature as peers compare it, field by field, in the order errors name them."""
    return {
        "collective": op.name,
        **{k: repr(v) for k, v in op.params},
        "groups": [list(g) for g in groups],
        "number of values": len(blocks),
        **dict(op.detail),
        "shapes": [list(b.shape[2:]) for b in blocks],
        "dtypes": [str(b.dtype) for b in blocks],
    }


class _Signature:
    """One compiled signature: its executable, the (group, slot) sharding of its inputs, and the
    staging buffers for host values, built by the first call that brings host values. The engine's
    lock serializes calls and each waits for its results, so XLA has read the buffers before the
    next call writes them (`HostBuffers`' lifetime rule); they never leave the engine."""

    def __init__(self, executable: Any, sharding: NamedSharding, lead: tuple[int, int]) -> None:
        self.executable, self.sharding, self.lead = executable, sharding, lead
        self.header: _Header | None = None
        self.staging: HostBuffers | None = None
        self._staging_tried = False

    def importer(self, device: Any) -> Callable[[np.ndarray], jax.Array | None]:
        """Makes a host block the global array of which it is the only shard, imported onto
        `device` without a copy (None where it cannot be: empty values, another jaxlib)."""
        def put(host: np.ndarray) -> jax.Array | None:
            block = import_buffer(host, device) if host.nbytes else None
            return None if block is None else self.global_array(block)
        return put

    def global_array(self, block: jax.Array) -> jax.Array:
        """The (groups, slots, *shape) global array of which `block` is this process's only shard."""
        return assemble(self.lead + block.shape[2:], self.sharding, [block])

    def inputs(self, blocks: list[jax.Array] | list[np.ndarray], device: Any) -> list[jax.Array]:
        """The executable's global inputs holding `blocks`' values: device blocks as they are, host
        blocks through the staging buffers, or, where XLA cannot share one, imported afresh."""
        if not isinstance(blocks[0], np.ndarray):
            return [self.global_array(b) for b in blocks]
        if not self._staging_tried:
            self._staging_tried = True
            self.staging = HostBuffers.build([(b.shape, b.dtype) for b in blocks], self.importer(device))
        if self.staging is not None:
            return self.staging.fill(blocks)
        inputs = []
        for host in blocks:
            block = import_buffer(host, device)
            inputs.append(self.global_array(jax.device_put(host, device) if block is None else block))
        return inputs


class _Header:
    """The header input of one signature's executable: a host array shared with XLA where it can
    be (written in place each call, like the staging buffers), else a fresh device copy per call."""

    def __init__(self, signature: _Signature, device: Any, host: np.ndarray, shared: jax.Array | None) -> None:
        self.signature, self.device, self.host, self.shared = signature, device, host, shared

    @classmethod
    def build(cls, signature: _Signature, device: Any) -> _Header:
        host = aligned((1, 1, HEADER), np.int32)
        return cls(signature, device, host, share(host, signature.importer(device)))

    def fill(self, rank: int, seq: int, fingerprint: tuple[int, int]) -> jax.Array:
        self.host[0, 0] = (rank, seq & 0x7FFFFFFF, *fingerprint)
        if self.shared is not None:
            return self.shared
        return self.signature.global_array(jax.device_put(self.host, self.device))


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """This process's engine for its current job, built on first use (joining the job if needed)
    and again after the process has left that job and joined another."""
    global _engine
    job = _runtime.job()
    found = _engine
    if found is None or found.job is not job:
        with _engine_lock:
            if _engine is None or _engine.job is not job:
                _engine = Engine(job)
            found = _engine
    return found


def collective_stats() -> CollectiveStats:
    """A snapshot of this process's collective counts in the current job. Example::

        before = tpudist.collective_stats()
        for _ in range(3):
            tpudist.all_reduce(torch.ones(4))
        after = tpudist.collective_stats()
        assert after.calls - before.calls == 3 and after.compiles - before.compiles <= 1
    """
    return dataclasses.replace(engine().stats)
