"""What one process knows of its peers: whether they called the same collective, and which of them
never came. Mismatches and missing peers become errors rather than hangs:

- the first time a process sees a signature, it publishes it in the coordinator's key-value store
  and compares it with every peer's at the same position in the sequence of collectives;
- XLA's gloo collectives time out after TPUDIST_COLLECTIVE_TIMEOUT seconds (init() passes it as
  --xla_cpu_collective_timeout_seconds); a process that timed out records its arrival in the
  key-value store and reads its peers', so the message names the ranks that never came.

In a single-process job there is no key-value store and no peer: every check passes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tpudist import contract

_ARRIVAL_GRACE = 2.0  # seconds a timed-out process gives its peers to record their arrival


class CollectiveError(RuntimeError):
    """A collective that cannot run: peers disagree, or an earlier collective failed."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """Peers did not reach a collective within the deadline."""


class Peers:
    """This process's side of the agreement with its peers, through the coordination service's
    key-value store `kv` (None: a single-process job). Keys live under `prefix`, one job's own."""

    def __init__(self, kv: Any, prefix: str, rank: int, n: int, host: str, timeout: float) -> None:
        self.kv, self.prefix = kv, prefix
        self.rank, self.n = rank, n
        self.me = f"rank {rank} on {host}"  # how every message names this process
        self.timeout = timeout

    def check(self, seq: int, name: str, mine: dict[str, Any], deadline: float) -> None:
        """Publishes collective #`seq`'s signature `mine` and compares it with every peer's.

        CollectiveError names the first field that differs; CollectiveTimeout, the ranks that did
        not publish theirs by `deadline` (time.monotonic()), after which this process's sequence of
        collectives is out of step with its peers'.
        """
        if self.kv is None:
            return
        base = f"{self.prefix}/sig/{seq}/"
        self.kv.key_value_set(base + str(self.rank), json.dumps(mine))
        for r in range(self.n):
            if r == self.rank:
                continue
            left_ms = int(max(1.0, (deadline - time.monotonic()) * 1000))
            try:
                theirs = json.loads(self.kv.blocking_key_value_get(base + str(r), left_ms))
            except Exception:  # noqa: BLE001 - the coordination service's timeout error
                raise self.timeout_error(seq, name, self._absent(base),
                                         "checking the collective's signature") from None
            for field, value in mine.items():
                if theirs.get(field) != value:
                    raise CollectiveError(
                        f"{self.me}: {name} (collective #{seq}) {field} {_show(value)} differs "
                        f"from rank {r}'s {_show(theirs.get(field))}; every process must call the "
                        "same collectives in the same order with the same shapes, dtypes and "
                        "parameters")

    def failure(self, seq: int, name: str, error: Exception, seconds: float) -> CollectiveError:
        """The job's error for collective #`seq`, whose execution raised `error` after `seconds`:
        a CollectiveTimeout naming the ranks that never arrived, or a CollectiveError."""
        if seconds >= 0.9 * self.timeout or "timed out" in str(error).lower():
            return self.timeout_error(seq, name, self._missing(seq), "waiting for peers")
        return CollectiveError(f"{self.me}: {name} (collective #{seq}) failed, most likely because "
                               f"a peer process died: {error}")

    def barrier(self, seq: int, timeout: float | None = None) -> None:
        """Waits until every process reaches barrier #`seq`, or raises CollectiveTimeout after
        `timeout` seconds (default: the job's collective timeout)."""
        if self.kv is None:
            return
        limit = timeout or self.timeout
        self._arrive(seq)
        try:
            self.kv.wait_at_barrier(f"{self.prefix}/barrier/{seq}", int(limit * 1000))
        except Exception:  # noqa: BLE001 - the coordination service's timeout error
            missing = self._absent(f"{self.prefix}/arrive/{seq}/")
            raise self.timeout_error(seq, "barrier", missing, "at the barrier", limit) from None

    def timeout_error(self, seq: int, name: str, missing: list[int], doing: str,
                      limit: float | None = None) -> CollectiveTimeout:
        who = f"ranks {missing} did not arrive" if missing else "peers did not finish"
        return CollectiveTimeout(
            f"{self.me}: {name} (collective #{seq}) timed out after {limit or self.timeout:g}s "
            f"{doing}: {who} (crashed, stuck, or called a different collective). "
            f"Raise {contract.COLLECTIVE_TIMEOUT} if steps are slow.")

    # -- arrivals -------------------------------------------------------------------------------

    def _missing(self, seq: int) -> list[int]:
        if self.kv is None:
            return []
        self._arrive(seq)
        time.sleep(_ARRIVAL_GRACE)  # peers that are also waiting time out about now and record theirs
        return self._absent(f"{self.prefix}/arrive/{seq}/")

    def _arrive(self, seq: int) -> None:
        try:
            self.kv.key_value_set(f"{self.prefix}/arrive/{seq}/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - best effort; only improves the timeout message
            pass

    def _absent(self, base: str) -> list[int]:
        """The other ranks with no key under `base` in the key-value store."""
        return [r for r in range(self.n) if r != self.rank and not self._has(base + str(r))]

    def _has(self, key: str) -> bool:
        try:
            return self.kv.key_value_try_get(key) is not None
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return False


def _show(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return ", ".join(str(tuple(v)) for v in value)
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)
