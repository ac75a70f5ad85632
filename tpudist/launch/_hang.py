"""Hang reports: when the job stops making progress, every rank's Python stacks in one table.

The supervisor tells a `HangWatch` what counts as progress: a line of output from any rank, and an
agent heartbeat whose count of eager collectives entered has changed (`tpudist/_stacks.py` records
them in shared memory; agents read it every heartbeat). When --hang-timeout seconds pass without
any (`due`), or on SIGQUIT, it sends every agent a Stacks request; each agent has its processes dump
their stacks (faulthandler, every thread) and answers. Once all have answered, or COLLECT_S passed,
`stacks_table` makes one table: rank, host, state, the main thread's innermost frame, the last
collective entered; and picks the likeliest culprit, the root cause when the job is ended for it
(--hang-action stop, exit status 124).

    watch = HangWatch(timeout_s=600)
    watch.restart(now)                        # an attempt starts
    watch.progress(now)                       # a line arrived
    if watch.due(now): request = watch.ask(workers, "no progress for 600 s", hang=True, now=now)
    watch.answer(worker, stacks_report)
    if (done := watch.finished(now)) is not None:
        text, root = stacks_table(attempt.states, done, ending=True)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import tpudist._stacks as _stacks
from tpudist.launch.attempt import ProcState
from tpudist.launch.control import control_pb2 as pb

COLLECT_S = 5.0  # agents' time to answer (each waits up to 3 s for its processes' dumps)
ROOT_DUMP_LINES = 40  # the culprit's full dump, every thread, under the table
_STATES = {"R": "running", "S": "sleeping", "D": "in I/O (D)", "T": "stopped", "t": "stopped (traced)",
           "Z": "zombie"}
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/|/tpudist/")


@dataclasses.dataclass
class Collection:
    """One round of stacks: why it was asked for, who must answer, what came back."""

    request: int
    reason: str
    hang: bool  # asked for because of --hang-timeout (not SIGQUIT)
    workers: frozenset[int]
    deadline: float
    reports: dict[int, pb.StacksReport] = dataclasses.field(default_factory=dict)


class HangWatch:
    """Progress seen, and the round of stacks under way (at most one)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.last = 0.0  # when progress was last seen
        self.counts: dict[int, int] = {}  # each worker's collectives entered, from its heartbeats
        self.collection: Collection | None = None
        self._requests = 0

    def restart(self, now: float) -> None:
        self.last, self.counts, self.collection = now, {}, None

    def progress(self, now: float) -> None:
        self.last = now

    def heartbeat(self, worker: int, count: int, now: float) -> None:
        if self.counts.get(worker) != count:
            self.counts[worker] = count
            self.last = now

    def due(self, now: float) -> bool:
        return self.timeout_s is not None and self.collection is None and now - self.last >= self.timeout_s

    def ask(self, workers: Sequence[int], reason: str, *, hang: bool, now: float) -> int | None:
        """Starts a round (None when one is under way); the caller sends Stacks(request) to `workers`."""
        if self.collection is not None:
            return None
        self._requests += 1
        self.collection = Collection(self._requests, reason, hang, frozenset(workers), now + COLLECT_S)
        return self._requests

    def answer(self, worker: int, report: pb.StacksReport) -> None:
        c = self.collection
        if c is not None and report.request == c.request:
            c.reports[worker] = report

    def finished(self, now: float) -> Collection | None:
        """The round, once every agent answered or its deadline passed (then it is over)."""
        c = self.collection
        if c is None or (now < c.deadline and not c.workers <= set(c.reports)):
            return None
        self.collection = None
        self.last = now  # --hang-action report: the next report only after another timeout
        return c


@dataclasses.dataclass(frozen=True)
class _Rank:
    state: ProcState
    stacks: pb.RankStacks | None
    main: tuple[_stacks.Frame, ...]  # the main thread's frames, innermost first

    @property
    def inside(self) -> str:
        """The collective whose frames are on the main thread now ("" none)."""
        if any("/tpudist/collectives/" in f.file for f in self.main):
            return (self.stacks.collective if self.stacks else "") or "a collective"
        return framework_collective(self.main)


# What a rank that never calls tpudist waits in, read from its frames (innermost first): the public
# torch.distributed collectives (their Python frames in distributed_c10d.py wait on the C++ work)
# and JAX's multi-process points (joining the job, syncing hosts, waiting for a computation's
# result, whose collectives run inside the executable).
_TORCH_COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "init_process_group", "new_group"))
_JAX_WAITS = {"block_until_ready": "block_until_ready", "_value": "reading its result",
              "__array__": "reading its result", "device_get": "device_get"}


def framework_collective(frames: Sequence[_stacks.Frame]) -> str:
    """The torch.distributed collective or JAX wait whose frames are in `frames` ("" none)."""
    for f in frames:
        if "/torch/distributed/" in f.file and f.function in _TORCH_COLLECTIVES:
            return f"torch.distributed.{f.function}"
    for f in reversed(frames):  # outermost first: the call the program made
        if f.file.endswith("/jax/_src/distributed.py") and f.function == "initialize":
            return "jax.distributed.initialize"
        if f.file.endswith("/jax/experimental/multihost_utils.py"):
            return f"jax.experimental.multihost_utils.{f.function}"
    for f in frames:
        if "/jax/_src/" in f.file and f.function in _JAX_WAITS:
            return f"a JAX computation ({_JAX_WAITS[f.function]})"
    return ""


def stacks_table(states: Sequence[ProcState], c: Collection, *, ending: bool) -> tuple[str, int | None]:
    """The table of every rank's stacks, and the likeliest culprit's rank (None when no rank runs);
    `ending`: the job ends for it, the culprit named its root cause."""
    by_rank = {rs.rank: rs for report in c.reports.values() for rs in report.ranks}
    ranks = []
    for s in states:
        rs = by_rank.get(s.plan.rank)
        main: tuple[_stacks.Frame, ...] = ()
        if rs is not None and rs.dump:
            threads = _stacks.parse_dump(rs.dump.decode(errors="replace"))
            main = next((t.frames for t in threads if t.ident == rs.main_thread), ())
        ranks.append(_Rank(s, rs, main))
    rows = [_row(r, c) for r in ranks]
    header = ("rank", "host", "state", "main thread's innermost frame", "last collective or step entered")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    root = _culprit(ranks)
    if root is not None:
        return "\n".join(lines + _explain(root, ranks, c, ending)), root.state.plan.rank
    lines.append(f"{'root cause' if ending else 'likely culprit'}: {c.reason}; no rank could show its Python "
                 "stacks (see the state column)")
    first = next((s for s in states if not s.done), None)
    return "\n".join(lines), (first.plan.rank if first is not None else None)


def _row(r: _Rank, c: Collection) -> tuple[str, ...]:
    s, rs = r.state, r.stacks
    host = str(s.plan.host.address)
    if rs is None:
        why = s.describe() if s.done else ("no answer from its host's agent" if s.plan.worker in c.workers
                                           else "its host's agent is gone")
        return str(s.plan.rank), host, why, "-", "-"
    state = _STATES.get(rs.state, rs.state)
    if r.inside:
        state += f", in {r.inside}"
    frame = rs.error or (_frame(r.main) if r.main else "no Python frame on the main thread")
    last = "-"
    if rs.collective:
        last = f"{rs.collective} #{rs.collectives}, entered {rs.collective_age_s:.1f}s ago"
    return str(s.plan.rank), host, state, frame, last


def _frame(frames: tuple[_stacks.Frame, ...]) -> str:
    """The innermost frame; when that is library code, also the program's innermost one."""
    text = frames[0].short()
    if _LIBRARY.search(frames[0].file):
        own = next((f for f in frames if not _LIBRARY.search(f.file)), None)
        if own is not None:
            text += f" (from {own.short()})"
    return text


def _culprit(ranks: list[_Rank]) -> _Rank | None:
    """The rank the others most likely wait for: outside any collective before one inside, fewest
    collectives entered, lowest rank."""
    dumped = [r for r in ranks if r.main]
    if not dumped:
        return None
    return min(dumped, key=lambda r: (bool(r.inside), r.stacks.collectives, r.state.plan.rank))


def _explain(root: _Rank, ranks: list[_Rank], c: Collection, ending: bool) -> list[str]:
    s = root.state
    waiting = [r for r in ranks if r.inside and r is not root]
    where = f"at {_frame(root.main)}"
    if not root.inside and waiting:
        names = sorted({r.inside for r in waiting})
        where += (f", outside any collective, while rank{'s' if len(waiting) > 1 else ''} "
                  f"{', '.join(str(r.state.plan.rank) for r in waiting)} wait{'' if len(waiting) > 1 else 's'} "
                  f"in {', '.join(names)}")
    elif root.inside:
        where += f", in {root.inside}, with the fewest collectives entered ({root.stacks.collectives})"
    lines = [f"{'root cause' if ending else 'likely culprit'}: {c.reason}; rank {s.plan.rank} on "
             f"{s.plan.host.address} (worker {s.plan.worker}, pid {root.stacks.pid}) is {where}",
             f"rank {s.plan.rank}'s threads (most recent call first):"]
    dump = root.stacks.dump.decode(errors="replace").splitlines()
    lines += ["  " + line for line in dump[:ROOT_DUMP_LINES] if line.strip()]
    if len(dump) > ROOT_DUMP_LINES:
        lines.append(f"  ... {len(dump) - ROOT_DUMP_LINES} more lines")
    return lines

