"""What the launcher shows about the job: a live status while starting, and the final table.

The table lists every process (host, worker, rank, exit code or signal, run time) with the first
failure marked as the root cause, followed by that process's last traceback lines. On a terminal
both are drawn with rich; otherwise the status is silent and the table is plain text.

    status = StartStatus(enabled=sys.stderr.isatty())
    status.update(hosts=64, connected=12, registered=3, running=0, processes=128, attempt=0)
    print(failure_table(attempt.result(), headline="tpudist: the job failed"), file=sys.stderr)
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Mapping, Sequence

from tpudist.launch.attempt import AttemptResult, Outcome, ProcState, Restarts
from tpudist.launch.clusters import Host


def failure_table(result: AttemptResult, *, headline: str = "") -> str:
    """The one table of the job's end, root cause first in attention, as text."""
    rows = []
    for s in result.states:
        mark = "<- root cause" if s.plan.rank == result.root_rank else ""
        run = f"{s.run_s:.1f}s" if s.run_s is not None else "-"
        rows.append((str(s.plan.host.address), str(s.plan.worker), str(s.plan.rank), s.describe(), run, mark))
    header = ("host", "worker", "rank", "result", "time", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [headline] if headline else []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    root = result.root
    if result.hang:  # --hang-timeout: every rank's stacks, the culprit's root cause line in it
        lines.append(result.hang)
    elif root is not None:
        lines.append(f"root cause (first observed failure): rank {root.plan.rank} on {root.plan.host.address} "
                     f"(worker {root.plan.worker}): {root.describe()}")
        lines.extend("  " + t.decode(errors="replace") for t in root.tail)
        if root.signal == signal.SIGKILL and not root.stopping:
            lines.append("  " + sigkill_hint(root))
    return "\n".join(lines)


def sigkill_hint(state: ProcState) -> str:
    """Under a rank that SIGKILL ended while the launcher was not stopping it: memory, most often."""
    host = state.plan.host.address
    where = "" if host in ("127.0.0.1", "localhost") else f"ssh {host} "
    return (f"hint: SIGKILL came from outside the job: on Linux most often the kernel's OOM killer (the host "
            f"ran out of memory), else an administrator or a scheduler. Check `{where}dmesg -T | grep -i "
            "oom` (or journalctl -k) and the process's memory use; lower it (batch size, processes per "
            "host) if memory ran out")


def ending_table(result: AttemptResult) -> str:
    """The table a failed or interrupted job ends with, under a headline saying which."""
    if result.outcome is Outcome.INTERRUPTED:
        headline = f"tpudist: stopped by {signal.Signals(result.interrupt).name}; every process was stopped"
    elif result.hang:
        headline = (f"tpudist: the job hung (exit status {result.exit_status}); every process was stopped"
                    + _after_restarts(result))
    else:
        headline = ("tpudist: the job failed; every other process was stopped"
                    + _after_restarts(result))
    return failure_table(result, headline=headline)


def _after_restarts(result: AttemptResult) -> str:
    """The headline's note on an attempt after the first, each earlier one having been restarted:
    " (attempt 3, after 2 restarts)"."""
    n = result.number
    return f" (attempt {n + 1}, after {n} restart{'s' if n > 1 else ''})" if n else ""


def restart_table(result: AttemptResult, restarts: Restarts) -> str:
    """The table of a failed attempt that is run again (`restarts` already counts this restart), with
    the cause that let --restart-on run it again."""
    return failure_table(result, headline=(f"tpudist: attempt {result.number + 1} failed; restarting "
                                           f"({restarts.used}/{restarts.limit} restarts): "
                                           + restarts.causes[-1]))


def version_skew(versions: Mapping[int, Mapping[str, str]], hosts: Sequence[Host]) -> list[str]:
    """One warning per package whose version differs across hosts (`versions`: worker -> name -> version)."""
    by_package: dict[str, dict[str, list[int]]] = {}
    for worker, found in versions.items():
        for name in set(found) | {"jax", "torch", "tpudist"}:
            by_package.setdefault(name, {}).setdefault(found.get(name, "missing"), []).append(worker)
    warnings = []
    for name, seen in sorted(by_package.items()):
        if len(seen) > 1:
            detail = "; ".join(f"{v} on {', '.join(hosts[w].address for w in sorted(ws)[:4])}"
                               + (f" (+{len(ws) - 4} more)" if len(ws) > 4 else "")
                               for v, ws in sorted(seen.items()))
            warnings.append(f"tpudist: warning: {name} versions differ across hosts: {detail}")
    return warnings


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
