"""What the launcher shows about the job: a live status while starting, and the final table.

The table lists every process (host, worker, rank, exit code or signal, run time) with the first
failure marked as the root cause, followed by that process's last traceback lines. On a terminal
both are drawn with rich; otherwise the status is silent and the table is plain text.

    status = StartStatus(enabled=sys.stderr.isatty())
    status.update(hosts=64, connected=12, registered=3, running=0, processes=128, attempt=0)
    print(failure_table(states, root_rank=3), file=sys.stderr)
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time

from tpudist.launch.plan import ProcessPlan

LOST_EXIT = 255  # like ssh: the connection to the host was lost


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

    def outcome(self) -> str:
        if self.lost:
            return f"lost ({self.lost})"
        if self.error:
            return f"exit {self.exit_code}: {self.error}"
        if self.signal:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return name + (" (stopped)" if self.stopping else "")
        if self.exit_code is not None:
            return f"exit {self.exit_code}"
        return "running" if self.pid else "not started"


def failure_table(states: list[ProcState], root_rank: int | None, *, headline: str = "") -> str:
    """The one table of the job's end, root cause first in attention, as text."""
    rows = []
    for s in states:
        mark = "<- root cause" if s.plan.rank == root_rank else ""
        run = f"{s.run_s:.1f}s" if s.run_s is not None else "-"
        rows.append((str(s.plan.host.address), str(s.plan.worker), str(s.plan.rank), s.outcome(), run, mark))
    header = ("host", "worker", "rank", "result", "time", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [headline] if headline else []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    root = next((s for s in states if s.plan.rank == root_rank), None)
    if root is not None:
        lines.append(f"root cause (first observed failure): rank {root.plan.rank} on {root.plan.host.address} "
                     f"(worker {root.plan.worker}): {root.outcome()}")
        lines.extend("  " + t.decode(errors="replace") for t in root.tail)
    return "\n".join(lines)


class StartStatus:
    """One live line while the job starts (hosts connecting / registered / running); rich, TTY only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()
        self._live = None
        if enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live("", console=Console(file=sys.stderr, highlight=False), transient=True,
                              refresh_per_second=8, redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def update(self, *, hosts: int, connected: int, registered: int, running: int, processes: int,
               attempt: int) -> None:
        if self._live is None:
            return
        again = f"  attempt {attempt + 1}" if attempt else ""
        self._live.update(f"[bold]tpudist[/] hosts: {connected}/{hosts} connected, {registered}/{hosts} "
                          f"registered; processes: {running}/{processes} running  "
                          f"{time.monotonic() - self.t0:.1f}s{again}")

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
