"""What one process knows of its peers: whether they called the same collective, and which of them
never came. Mismatches and missing peers become errors rather than hangs:

- every call's executable exchanges a header (rank, sequence number, signature fingerprint) first
  and runs the collective only where all agree (`_engine`); where they do not, each process
  publishes its signature in the coordinator's key-value store and reads the differing peer's, so
  the error names the field and both values;
- the first time a process uses a replica-group layout other than one group of all, it publishes
  the layout in the key-value store and reads its peers' for the same call: layouts that disagree
  would put each process in a different executable's exchange (XLA:CPU then waits ~30 s to connect
  peers that never come), and are named at once instead;
- XLA's gloo collectives time out after TPUDIST_COLLECTIVE_TIMEOUT seconds (init() passes it as
  --xla_cpu_collective_timeout_seconds); a process that timed out records its arrival, with its
  call's replica groups, in the key-value store and reads its peers', so the message names the ranks
  that never came, or the groups that differ. Every timeout message quotes the time actually waited.

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

    def mismatch(self, seq: int, name: str, rows: Any, mine: dict[str, Any], deadline: float) -> CollectiveError:
        """The error for collective #`seq`, whose header exchange found peers that disagree.

        `rows` holds every process's header (rank, sequence number, fingerprint), `mine` this
        call's signature field by field. Every process that disagrees publishes its signature in
        the key-value store and reads the first differing peer's (until `deadline`), so both sides
        name the same field.
        """
        base = f"{self.prefix}/sig/"
        self.kv.key_value_set(f"{base}{seq & 0x7FFFFFFF}/{self.rank}", json.dumps(mine))
        me = next(row for row in rows if int(row[0]) == self.rank)
        other = next(row for row in rows if tuple(row[1:]) != tuple(me[1:]))
        r, their_seq = int(other[0]), int(other[1])
        rule = ("every process must call the same collectives in the same order with the same "
                "structures, shapes, dtypes and parameters")
        head = f"{self.me}: {name} (collective #{seq})"
        if their_seq != int(me[1]):
            return CollectiveError(f"{head} met rank {r}'s collective #{their_seq}: the processes have "
                                   f"called different numbers of collectives; {rule}")
        left_ms = int(max(1.0, (deadline - time.monotonic()) * 1000))
        try:
            theirs = json.loads(self.kv.blocking_key_value_get(f"{base}{their_seq}/{r}", left_ms))
        except Exception:  # noqa: BLE001 - the coordination service's timeout error
            return CollectiveError(f"{head}: rank {r} called a different collective (its signature "
                                   f"did not arrive to say which); {rule}")
        for field in list(mine) + [f for f in theirs if f not in mine]:
            if theirs.get(field) != mine.get(field):
                return CollectiveError(f"{head} {field} {_show(mine.get(field))} differs from rank {r}'s "
                                       f"{_show(theirs.get(field))}; {rule}")
        return CollectiveError(f"{head}: rank {r} called it with a signature that hashes differently "
                               f"but reads the same ({mine}); {rule}")

    def agree_groups(self, seq: int, name: str, groups: Any) -> None:
        """Checks with every peer that collective #`seq` uses the same replica groups, the first time
        this process uses `groups`: a CollectiveError naming both layouts when a peer's differ, a
        CollectiveTimeout after the collective timeout when a peer never publishes its own (it
        called the collective with a layout it had used before, or is stuck)."""
        if self.kv is None:
            return
        base = f"{self.prefix}/groups/{seq & 0x7FFFFFFF}/"
        mine = _layout(groups)
        self.kv.key_value_set(base + str(self.rank), mine)
        start = time.monotonic()
        deadline = start + self.timeout
        for r in range(self.n):
            if r == self.rank:
                continue
            left_ms = int(max(1.0, (deadline - time.monotonic()) * 1000))
            try:
                theirs = self.kv.blocking_key_value_get(base + str(r), left_ms)
            except Exception:  # noqa: BLE001 - the coordination service's timeout error
                missing = self._absent(base)
                raise CollectiveTimeout(
                    f"{self.me}: {name} (collective #{seq}) timed out after {time.monotonic() - start:.1f}s "
                    f"waiting for ranks {missing} to confirm its replica groups {_show(json.loads(mine))} "
                    f"(this process uses them for the first time): they called it with groups they had used "
                    f"before, called another collective, or are stuck. Every process must pass the same "
                    f"groups; raise {contract.COLLECTIVE_TIMEOUT} if steps are slow.") from None
            if theirs != mine:
                raise CollectiveError(
                    f"{self.me}: {name} (collective #{seq}) groups {_show(json.loads(mine))} differ from rank "
                    f"{r}'s {_show(json.loads(theirs))}; every process must pass the same replica groups "
                    f"(each process's own group is the one it is in)")

    def failure(self, seq: int, name: str, error: Exception, seconds: float,
                groups: Any = None) -> CollectiveError:
        """The job's error for collective #`seq`, whose execution raised `error` after `seconds`:
        a CollectiveError naming the replica groups that differ, a CollectiveTimeout naming the
        ranks that never arrived, or a CollectiveError."""
        if seconds >= 0.9 * self.timeout or "timed out" in str(error).lower():
            mine = _layout(groups) if groups is not None else "1"
            arrivals = self._arrivals(seq, mine)
            for r, theirs in arrivals.items():
                if theirs not in ("1", mine) and groups is not None:
                    return CollectiveError(
                        f"{self.me}: {name} (collective #{seq}) timed out after {seconds:.1f}s: its groups "
                        f"{_show(json.loads(mine))} differ from rank {r}'s {_show(json.loads(theirs))}; every "
                        f"process must pass the same replica groups")
            missing = [r for r in range(self.n) if r != self.rank and r not in arrivals]
            return self.timeout_error(seq, name, missing, "waiting for peers", seconds)
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
                      waited: float | None = None) -> CollectiveTimeout:
        """`waited`: the seconds actually waited (the message quotes them); default the timeout."""
        who = f"ranks {missing} did not arrive" if missing else "peers did not finish"
        waited = self.timeout if waited is None else waited
        longer = (f" (XLA waited longer than {contract.COLLECTIVE_TIMEOUT}={self.timeout:g}s: its first "
                  f"connection to these peers has a deadline of its own)") if waited > 1.5 * self.timeout else ""
        return CollectiveTimeout(
            f"{self.me}: {name} (collective #{seq}) timed out after {waited:.1f}s{longer} "
            f"{doing}: {who} (crashed, stuck, or called a different collective). "
            f"Raise {contract.COLLECTIVE_TIMEOUT} if steps are slow.")

    # -- arrivals -------------------------------------------------------------------------------

    def _arrivals(self, seq: int, mine: str) -> dict[int, str]:
        """Records this process's arrival at collective #`seq` (with `mine`, its groups), waits for
        peers that also time out about now to record theirs, and returns theirs by rank."""
        if self.kv is None:
            return {}
        self._arrive(seq, mine)
        time.sleep(_ARRIVAL_GRACE)
        return self._values(f"{self.prefix}/arrive/{seq}/")

    def _arrive(self, seq: int, value: str = "1") -> None:
        try:
            self.kv.key_value_set(f"{self.prefix}/arrive/{seq}/{self.rank}", value)
        except Exception:  # noqa: BLE001 - best effort; only improves the timeout message
            pass

    def _absent(self, base: str) -> list[int]:
        """The other ranks with no key under `base` in the key-value store."""
        present = self._values(base)
        return [r for r in range(self.n) if r != self.rank and r not in present]

    def _values(self, base: str) -> dict[int, str]:
        """The other ranks' values under `base` in the key-value store, by rank."""
        found = {}
        for r in range(self.n):
            if r != self.rank:
                try:
                    value = self.kv.key_value_try_get(base + str(r))
                except Exception:  # noqa: BLE001 - NOT_FOUND
                    value = None
                if value is not None:
                    found[r] = value
        return found


def _layout(groups: Any) -> str:
    """Replica groups as peers compare them (the same text on every process)."""
    return json.dumps([list(g) for g in groups])


def _show(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return ", ".join(str(tuple(v)) for v in value)
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)
