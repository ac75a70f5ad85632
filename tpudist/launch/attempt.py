"""One attempt of a job as a state machine: what the launcher knows of every process, and what it means.

The supervisor feeds an `Attempt` what the agents report (a process started, exited, a host was
lost) and what the user did (Ctrl-C); the attempt decides what that means: which failure is the
root cause (the first one observed, never a process the launcher itself was stopping), when the
others must be stopped, and how the attempt ended. `Restarts` keeps the `--max-restarts` budget.
No I/O, clocks or threads here, so every rule is tested directly (tests/launch/test_attempt.py).

    attempt = Attempt(plan, number=0)
    attempt.started(0, rank=1, pid=4242)
    attempt.exited(0, rank=1, exit=Exit(code=3, run_s=1.2))
    assert attempt.phase is Phase.STOP          # a failure: stop every other process
    attempt.begin_stop()                        # ... their exits arrive ...
    result = attempt.result()                   # Outcome.FAILURE, root_rank=1, exit_status=3
    if restarts.take(result): ...               # run again while --max-restarts and --restart-on allow
"""

from __future__ import annotations

import dataclasses
import enum
import signal as _signal
from collections.abc import Sequence

from tpudist.launch.plan import ProcessPlan

LOST_EXIT = 255  # like ssh: the connection to the host was lost
HANG_EXIT = 124  # like timeout(1): no progress for --hang-timeout, and --hang-action stop
NO_EXIT_REPORT = "did not report its exit in time"


class Phase(enum.Enum):
    """Where an attempt is; the supervisor's loop does one thing per phase."""

    RUNNING = "running"  # processes run and nothing went wrong: wait for reports
    STOP = "stop"  # a failure or an interrupt: every other process must be stopped now
    STOPPING = "stopping"  # stop sent: wait for the exits (SIGKILL after the grace period)
    ENDED = "ended"  # every process exited or was given up on


class Outcome(enum.Enum):
    """How an attempt ended."""

    SUCCESS = "success"  # every process exited 0
    FAILURE = "failure"  # a process failed (or its host was lost): the root cause
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM to the launcher


@dataclasses.dataclass(frozen=True)
class Exit:
    """One process's end, as its agent reported it."""

    code: int = 0  # the exit status (0 when it died by a signal)
    signal: int | None = None  # the signal that ended it
    run_s: float | None = None
    tail: tuple[bytes, ...] = ()  # its last traceback (or stderr lines)
    error: str = ""  # why it could not start (command not found, ...)


@dataclasses.dataclass
class ProcState:
    """What the launcher knows of one process in the current attempt."""

    plan: ProcessPlan
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    run_s: float | None = None
    tail: list[bytes] = dataclasses.field(default_factory=list)
    error: str = ""
    lost: str = ""  # why the host's agent went away, if it did before this process exited
    stopping: bool = False  # it was still running when the launcher began stopping the job

    @property
    def done(self) -> bool:
        return self.exit_code is not None or self.signal is not None or bool(self.lost)

    @property
    def failed(self) -> bool:
        return bool(self.lost) or bool(self.signal) or bool(self.exit_code)

    def exit_status(self) -> int:
        """The shell-style status: the exit code, 128+N for signal N, 255 for a lost host."""
        if self.lost:
            return LOST_EXIT
        if self.signal:
            return 128 + self.signal
        return self.exit_code or 0

    def describe(self) -> str:
        """The result column of the failure table."""
        if self.lost:
            return f"lost ({self.lost})"
        if self.error:
            return f"exit {self.exit_code}: {self.error}"
        if self.signal:
            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return name + (" (stopped)" if self.stopping else "")
        if self.exit_code is not None:  # "(stopped)": it ended by itself once asked to (SIGTERM)
            return f"exit {self.exit_code}" + (" (stopped)" if self.stopping else "")
        return "running" if self.pid else "not started"


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    """How one attempt ended: the outcome, the root cause, every process's state."""

    number: int  # 0 for the first attempt
    outcome: Outcome
    states: tuple[ProcState, ...]
    root_rank: int | None = None  # the first observed failure (FAILURE only)
    interrupt: int | None = None  # the signal that interrupted it (INTERRUPTED only)
    hang: str = ""  # the hang report (every rank's stacks) when --hang-timeout ended it

    @property
    def root(self) -> ProcState | None:
        return next((s for s in self.states if s.plan.rank == self.root_rank), None)

    @property
    def exit_status(self) -> int:
        """The launcher's exit status: 0, the root cause's status, or 128+N after signal N."""
        if self.outcome is Outcome.INTERRUPTED:
            return 128 + (self.interrupt or 0)
        if self.outcome is Outcome.FAILURE:
            return HANG_EXIT if self.hang else self.root.exit_status()
        return 0


class Attempt:
    """One run of every process of the plan; reports for other attempts are ignored."""

    def __init__(self, plan: Sequence[ProcessPlan], number: int = 0) -> None:
        self.number = number
        self.states = [ProcState(p) for p in plan]
        self._by_rank = {s.plan.rank: s for s in self.states}
        self.root: int | None = None  # rank of the first observed failure
        self.interrupts: list[int] = []  # signals to the launcher, in order
        self.stopping = False
        self.hang = ""

    # -- what happened ---------------------------------------------------------------------------

    def started(self, number: int, rank: int, pid: int) -> None:
        if number == self.number and rank in self._by_rank:
            self._by_rank[rank].pid = pid

    def exited(self, number: int, rank: int, exit: Exit) -> None:
        if number != self.number or rank not in self._by_rank:
            return
        s = self._by_rank[rank]
        s.exit_code, s.signal = exit.code or 0, exit.signal or None
        s.run_s, s.tail, s.error = exit.run_s, list(exit.tail), exit.error
        self._note_failure(s)

    def host_lost(self, worker: int, reason: str) -> None:
        """A host's agent (or its connection) is gone: its running processes are lost."""
        for s in self.states:
            if s.plan.worker == worker and not s.done:
                s.lost = f"host agent gone: {reason}"
                self._note_failure(s)

    def hung(self, rank: int, report: str) -> None:
        """No progress for --hang-timeout: the attempt fails, `rank` (the likeliest culprit of
        `report`, every rank's stacks) its root cause."""
        if self.root is None and not self.stopping:
            self.root, self.hang = rank, report

    def interrupt(self, signum: int) -> None:
        self.interrupts.append(signum)

    def begin_stop(self) -> None:
        """The launcher stops every process still running; their failures are not root causes."""
        self.stopping = True
        for s in self.states:
            if not s.done:
                s.stopping = True

    def give_up(self, reason: str = NO_EXIT_REPORT) -> None:
        """After the stop deadline: processes that never reported their exit count as lost."""
        for s in self.states:
            if not s.done:
                s.lost = reason

    def _note_failure(self, s: ProcState) -> None:
        if s.failed and self.root is None and not s.stopping:
            self.root = s.plan.rank

    # -- what it means ---------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        if not self.stopping and (self.root is not None or self.interrupts):
            return Phase.STOP
        if all(s.done for s in self.states):
            return Phase.ENDED
        return Phase.STOPPING if self.stopping else Phase.RUNNING

    def running(self) -> int:
        """Processes started and not yet ended."""
        return sum(1 for s in self.states if s.pid and not s.done)

    def all_started(self) -> bool:
        return all(s.pid or s.done for s in self.states)

    def result(self) -> AttemptResult:
        """The outcome; an attempt ends when every process has (see `phase`)."""
        if self.interrupts:
            outcome = Outcome.INTERRUPTED
        elif self.root is not None:
            outcome = Outcome.FAILURE
        else:
            assert all(s.done and not s.failed for s in self.states), "result() of an attempt still running"
            outcome = Outcome.SUCCESS
        return AttemptResult(self.number, outcome, tuple(self.states),
                             root_rank=self.root if outcome is Outcome.FAILURE else None,
                             interrupt=self.interrupts[0] if self.interrupts else None,
                             hang=self.hang if outcome is Outcome.FAILURE else "")


RESTART_EXIT = 42  # a program asks to be run again (as with xpk): it restarts under --restart-on infra


@dataclasses.dataclass(frozen=True)
class Cause:
    """Why an attempt failed, as `--restart-on` sees it: "infra" (the machine, the network, someone
    outside the job: running again may well succeed), "hang" (no progress for --hang-timeout), or
    "program" (the program's own error)."""

    kind: str
    text: str  # "rank 1 exited 1 (an error in the program)"


def failure_cause(result: AttemptResult) -> Cause:
    """The cause of a failed attempt, from its root cause: a lost host or SSH connection, death by a
    signal (SIGKILL: the OOM killer or a preemption; SIGTERM from outside: a preemption), exit 42 or
    128+ are infra; any other exit status, a hang, or a command that could not start are the program's."""
    s = result.root
    assert s is not None, "failure_cause() of an attempt that did not fail"
    rank = f"rank {s.plan.rank}"
    if result.hang:
        return Cause("hang", f"{rank} hung (no progress for --hang-timeout)")
    if s.lost:
        return Cause("infra", f"{rank}'s host {s.plan.host.address} was lost ({s.lost})")
    if s.error:
        return Cause("program", f"{rank} could not start ({s.error})")
    if s.signal:
        why = {_signal.SIGKILL: "the OOM killer, a preemption or a kill -9",
               _signal.SIGTERM: "sent from outside the launcher: a preemption?"}.get(s.signal, "")
        return Cause("infra", f"{rank} was killed by {s.describe()}" + (f" ({why})" if why else ""))
    code = s.exit_status()
    if code == RESTART_EXIT:
        return Cause("infra", f"{rank} exited {code} (asks to be restarted)")
    if code >= 128:
        return Cause("infra", f"{rank} exited {code} (128+{code - 128}: a signal)")
    return Cause("program", f"{rank} exited {code} (an error in the program)")


@dataclasses.dataclass
class Restarts:
    """The `--max-restarts` budget: a failed attempt runs again while restarts are left and its cause
    is one `--restart-on` restarts (a comma list of "infra", "hang": see `failure_cause`; "any":
    every failure)."""

    limit: int
    on: str = "infra"
    used: int = 0
    causes: list[str] = dataclasses.field(default_factory=list)  # of every restart, in order

    def take(self, result: AttemptResult) -> bool:
        """Uses one restart for a failed (not interrupted) attempt; False when none is left or its
        cause is the program's own under --restart-on infra (`refusal` says why)."""
        if result.outcome is not Outcome.FAILURE or self.used >= self.limit:
            return False
        cause = failure_cause(result)
        if not self.restarts(cause):
            return False
        self.used += 1
        self.causes.append(cause.text)
        return True

    def refusal(self, result: AttemptResult) -> str:
        """Why a failed attempt is not run again although --max-restarts asked for restarts ("": it
        is, or none were asked for)."""
        if result.outcome is not Outcome.FAILURE or not self.limit:
            return ""
        if self.used >= self.limit:
            return f"not restarting: all {self.limit} restarts of --max-restarts {self.limit} are used"
        cause = failure_cause(result)
        if not self.restarts(cause):
            wider = f"{self.on},hang" if cause.kind == "hang" else "any"
            return f"not restarting: {cause.text}; --restart-on {wider} restarts it"
        return ""

    def restarts(self, cause: Cause) -> bool:
        """Whether --restart-on covers `cause`."""
        kinds = self.on.split(",")
        return "any" in kinds or cause.kind in kinds
