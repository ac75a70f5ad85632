"""What reaches the supervisor's loop, and how each event becomes a call on the current `Attempt`.

Control events (an agent registered, its session opened or was lost, its reports: log lines,
heartbeats, stacks, starts and exits) arrive from the control server; the launcher's own signals
arrive from `signal_handlers`. `EventHandling` is the part of `Supervisor` (supervisor.py) that
drains them; it holds no state of its own (the supervisor's: attempt, agents, registered,
sessions, sink, hangs, status, server).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import time

from tpudist.launch._wake import WakeQueue
from tpudist.launch.attempt import Exit, Phase
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.control._server import AgentReport, ControlEvent, Registered, SessionLost, SessionOpened

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # passed on to every process group of the job


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """SIGINT or SIGTERM reached the launcher (queued by its signal handler)."""

    signum: int


@dataclasses.dataclass(frozen=True)
class ForwardSignal:
    """SIGUSR1 or SIGUSR2 reached the launcher: pass it on to every process group of the job."""

    signum: int


@dataclasses.dataclass(frozen=True)
class DumpStacks:
    """SIGQUIT reached the launcher: print every rank's Python stacks; the job runs on."""


Event = ControlEvent | Interrupt | ForwardSignal | DumpStacks


class EventHandling:
    """The supervisor's event handling, as methods of `Supervisor`."""

    def _drain(self, timeout: float) -> None:
        """Handles every event that arrives within `timeout` (at least waits for one)."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: Event) -> None:
        attempt = self.attempt
        match event:
            case Registered(worker, request):
                self.registered[worker] = request
            case SessionOpened(worker):
                self.sessions.add(worker)
            case SessionLost(worker, reason):
                self.sessions.discard(worker)
                agent = self.agents.get(worker)
                if agent is not None and agent.exit_status() == -1:
                    reason = agent.LOST
                if attempt is not None:
                    attempt.host_lost(worker, reason)
            case AgentReport(_, message):
                self._on_report(message)
            case Interrupt():
                pass  # recorded by the signal handler; the event wakes whichever loop is waiting
            case ForwardSignal(signum):
                self._broadcast(pb.LauncherMessage(signal=pb.Signal(signum=signum)))
            case DumpStacks():
                if attempt is not None and attempt.phase is Phase.RUNNING:
                    self._ask_stacks("asked for with SIGQUIT", hang=False)

    def _on_report(self, msg: pb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        attempt = self.attempt
        if kind == "logs":
            if self.sink is not None:
                self.sink.write_batch(msg.logs.lines)
            for line in msg.logs.lines:
                if line.chatter and line.rank == 0:
                    self.goodput.read(line.data)
            if any(not line.chatter for line in msg.logs.lines):
                self.hangs.progress(time.monotonic())
        elif kind == "heartbeat":
            self.hangs.heartbeat(msg.worker, msg.heartbeat.progress, time.monotonic())
        elif kind == "stacks":
            self.hangs.answer(msg.worker, msg.stacks)
        elif kind == "started" and attempt is not None:
            attempt.started(msg.started.attempt, msg.started.rank, msg.started.pid)
            if attempt.all_started():
                self.status.stop()
        elif kind == "exited" and attempt is not None:
            attempt.exited(msg.exited.attempt, msg.exited.rank, _exit_of(msg.exited))

    def _broadcast(self, msg: pb.LauncherMessage) -> None:
        if self.server is not None:
            for worker in list(self.sessions):
                self.server.send(worker, msg)


@contextlib.contextmanager
def signal_handlers(interrupts: list[int], events: WakeQueue):
    """SIGINT/SIGTERM recorded in `interrupts` (and an Interrupt event to wake the loop); SIGUSR1/2
    queued to be passed on to the job; SIGQUIT (Ctrl-\\) asks for every rank's stacks. The previous
    handlers come back afterwards."""
    def on_signal(signum, frame) -> None:
        interrupts.append(signum)
        events.put(Interrupt(signum))

    def forward(signum, frame) -> None:  # e.g. a checkpoint request for every process
        events.put(ForwardSignal(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous.update({s: signal.signal(s, forward) for s in FORWARDED_SIGNALS})
    previous[signal.SIGQUIT] = signal.signal(signal.SIGQUIT, lambda *_: events.put(DumpStacks()))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_of(e: pb.Exited) -> Exit:
    return Exit(code=e.exit_code, signal=e.signal or None, run_s=e.run_s, tail=tuple(e.tail), error=e.error)
