"""Running one job: connect, register, then attempts until one ends the job; the I/O around `Attempt`.

The supervisor does the launcher's I/O on its main thread: it starts the agents, runs the control
server, and turns what arrives into calls on the current `Attempt` (the job's state machine, in
attempt.py), then does what the attempt's phase asks:

    CONNECTING   agents start on every host in parallel (_transport.open_agents)
    REGISTERING  every agent registers (versions, its TPU preflight; worker 0 also free ports) and
                 opens its Session; a host whose TPU is busy stops the launch here (_preflight.py)
    then, per attempt (`Restarts` decides whether a failed attempt runs again):
      RUNNING    lines are printed, exits recorded; a failure, a lost host or Ctrl-C ends it
      STOP       SIGTERM to every process group on every host ...
      STOPPING   ... a grace period, then SIGKILL; wait for every exit
      ENDED      the table (root cause first) and the exit status; under --profile, every host's
                 traces copied back (_profile.py)

Anything that goes wrong before an attempt runs raises LaunchError naming the hosts; `close()`
always takes every agent down, so nothing of the job is left running anywhere.

    sup = Supervisor(config, cluster)
    try:
        code = sup.run()
    finally:
        sup.close()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import secrets
import signal
import sys
import threading
import time

from tpudist import _proc
from tpudist.launch._output import LogSink
from tpudist.launch._preflight import preflight_paths, refusal
from tpudist.launch._report import StartStatus, ending_table, restart_table, version_skew
from tpudist.launch._transport import AgentHandle, close_agents, open_agents, reach_address
from tpudist.launch._wake import WakeQueue
from tpudist.launch.attempt import Attempt, AttemptResult, Exit, Outcome, Phase, Restarts
from tpudist.launch.config import LaunchConfig
from tpudist.launch.control import Bootstrap
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.control._server import AgentReport, ControlEvent, Registered, SessionLost, SessionOpened
from tpudist.launch.plan import ProcessPlan, build_plan, choose_ports, processes_per_host, python_env
from tpudist.launch.clusters import Cluster

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # passed on to every process group of the job
STOP_MARGIN_S = 3.0  # after the grace period: time for SIGKILL and the exit reports to arrive
SERVER_START_S = 30.0


class LaunchError(Exception):
    """The job could not be started; the message names the hosts and the fix."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) before the processes ran."""


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """SIGINT or SIGTERM reached the launcher (queued by its signal handler)."""

    signum: int


@dataclasses.dataclass(frozen=True)
class ForwardSignal:
    """SIGUSR1 or SIGUSR2 reached the launcher: pass it on to every process group of the job."""

    signum: int


Event = ControlEvent | Interrupt | ForwardSignal


def process_spec(p: ProcessPlan) -> pb.ProcessSpec:
    """A planned process as the agent's Start carries it: argv and env as bytes."""
    return pb.ProcessSpec(
        rank=p.rank, local_rank=p.local_rank, argv=[os.fsencode(a) for a in p.argv],
        env=[pb.EnvVar(name=os.fsencode(k), value=os.fsencode(v)) for k, v in p.env.items()],
        path_prepend=[os.fsencode(d) for d in p.path_prepend], cwd=os.fsencode(p.cwd),
        conda_env=p.conda_env or "")


class Supervisor:
    """Runs a job on a resolved cluster: agents, control server, attempts, teardown."""

    def __init__(self, config: LaunchConfig, cluster: Cluster) -> None:
        self.config, self.cluster = config, cluster
        self.hosts = cluster.hosts
        self.job_id = secrets.token_hex(6)
        self.token = secrets.token_urlsafe(32)
        self.events: WakeQueue[Event] = WakeQueue()  # put() is safe in a signal handler
        self.server = None  # the ControlServer, started while the hosts connect
        self.agents: dict[int, AgentHandle] = {}
        self.registered: dict[int, pb.RegisterRequest] = {}
        self.sessions: set[int] = set()
        self.connected = 0
        self.attempt: Attempt | None = None
        self.restarts = Restarts(config.job.max_restarts)
        self.interrupts: list[int] = []  # signal numbers, in order
        self.nprocs = sum(processes_per_host(config.procs, cluster))
        tty = sys.stderr.isatty() and sys.stdout.isatty()
        self.status = StartStatus(enabled=tty and not config.output.quiet)
        self.sink: LogSink | None = None
        self.t0 = time.monotonic()

    # -- the sequence ------------------------------------------------------------------------------

    def run(self) -> int:
        with _signal_handlers(self.interrupts, self.events):
            self._connect()
            self._await_agents()
            while True:
                result = self._run_attempt(self._start_attempt())
                if not self.restarts.take(result):
                    return self._finish(result)
                self._print(restart_table(result, self.restarts))

    def _start_server(self, port: concurrent.futures.Future) -> None:
        """Starts the control server; `port` gets its port, or the error, for the agents' side."""
        from tpudist.launch.control._server import ControlServer  # grpc: imported while SSH handshakes run

        try:
            self.server = ControlServer(self.token, self.events, self.job_id)
            port.set_result(self.server.start())
        except BaseException as e:
            port.set_exception(e)
            raise

    def _connect(self) -> None:
        """CONNECTING: agents start on every host while the control server starts here."""
        port: concurrent.futures.Future[int] = concurrent.futures.Future()
        results: dict = {}

        def connect() -> None:
            results.update(open_agents(
                self.cluster, python=python_env(self.config.procs).interpreter,
                make_bootstrap=_bootstrap_for(self.token, preflight_paths(self.config)),
                control_port=lambda: _port_of(port),
                ssh_options=None if self.cluster.local else self.config.ssh,
                on_connected=self._count_connected, poll=lambda: bool(self.interrupts)))

        # The local agent dials the server directly, so it must be up first; and the local agent's
        # death signal is tied to the thread that starts it, so it starts here.
        if self.cluster.local:
            self._start_server(port)
            connect()
        else:
            connecting = threading.Thread(target=connect, name="tpudist-connect", daemon=True)
            connecting.start()
            self._start_server(port)
            while connecting.is_alive():  # open_agents has its own deadline
                connecting.join(timeout=0.1)
                self._show_status()
        self.agents = {w: r for w, r in results.items() if not isinstance(r, Exception)}
        self.connected = len(self.agents)
        if self.interrupts:
            raise Interrupted()
        failed = sorted((w, r) for w, r in results.items() if isinstance(r, Exception))
        if failed:
            lines = "\n".join(f"  {r}" for _, r in failed)
            raise LaunchError(f"cannot start the job on {len(failed)} of {len(self.hosts)} hosts:\n{lines}")

    def _await_agents(self) -> None:
        """REGISTERING: every agent registers and opens its session, within --start-timeout."""
        timeout = self.config.job.start_timeout
        deadline = time.monotonic() + timeout
        want = set(range(len(self.hosts)))
        next_liveness = 0.0
        while not (want <= self.sessions and want <= set(self.registered)):
            if self.interrupts:
                raise Interrupted()
            now = time.monotonic()
            if now > deadline:
                late = sorted(want - self.sessions)
                raise LaunchError(f"no agent report within --start-timeout {timeout:g} s from "
                                  + ", ".join(str(self.hosts[w]) for w in late))
            # Every agent's SSH channel, a few times a second: each report wakes this loop, and
            # checking all of them on every wake-up was ~10% of the launcher's Python time at 64 hosts.
            if now >= next_liveness:
                next_liveness = now + 0.2
                if self._dead_agents():
                    time.sleep(0.5)  # the same problem usually hits every host: name them all at once
                    python = python_env(self.config.procs).interpreter
                    raise LaunchError("\n".join(a.describe_failure(python) for a in self._dead_agents()))
            self._drain(timeout=0.1)
            self._show_status()
        for warning in version_skew({w: r.versions for w, r in self.registered.items()}, self.hosts):
            self._print(warning)
        if busy := refusal({w: r.tpu for w, r in self.registered.items()}, self.hosts):
            raise LaunchError(busy)

    def _start_attempt(self) -> Attempt:
        probed = _proc.free_ports(2) if self.cluster.local else list(self.registered[0].free_ports)
        plan = build_plan(self.config.procs, self.cluster, choose_ports(self.config.job, probed),
                          job_id=self.job_id, attempt=self.restarts.used,
                          coordinator=reach_address(self.cluster, self.config.ssh),
                          stop_grace=self.config.job.stop_grace)
        if self.sink is None:
            out = self.config.output
            self.sink = LogSink(out.log_prefix, plan, ranks=out.ranks, log_dir=out.log_dir, verbose=out.verbose)
            self.sink.before_first_line = self.status.stop
        self.attempt = Attempt(plan, number=self.restarts.used)
        for worker in range(len(self.hosts)):
            specs = [process_spec(p) for p in plan if p.worker == worker]
            self.server.send(worker, pb.LauncherMessage(start=pb.Start(
                attempt=self.attempt.number, processes=specs, grace_s=self.config.job.stop_grace)))
        return self.attempt

    def _run_attempt(self, attempt: Attempt) -> AttemptResult:
        """The attempt's loop: one step per phase until every process has ended."""
        grace = self.config.job.stop_grace
        hard = False  # a second Ctrl-C: kill at once
        deadline = 0.0
        while True:
            self._feed_interrupts(attempt)
            phase = attempt.phase
            if phase is Phase.ENDED:
                return attempt.result()
            if phase is Phase.RUNNING:
                self._drain(timeout=0.2)
                self._show_status()
            elif phase is Phase.STOP:
                attempt.begin_stop()
                hard = len(self.interrupts) >= 2
                self._broadcast(pb.LauncherMessage(stop=pb.Stop(grace_s=0.0 if hard else grace)))
                deadline = time.monotonic() + (0 if hard else grace) + STOP_MARGIN_S
            elif time.monotonic() >= deadline:  # STOPPING, and not every exit has arrived
                attempt.give_up()
            else:
                if len(self.interrupts) >= 2 and not hard:
                    hard = True
                    self._broadcast(pb.LauncherMessage(stop=pb.Stop(grace_s=0.0)))
                    deadline = min(deadline, time.monotonic() + 1.5)
                self._drain(timeout=0.1)

    def _feed_interrupts(self, attempt: Attempt) -> None:
        """Signals reach the attempt from the handler's list; an Interrupt event only wakes the loop."""
        for signum in self.interrupts[len(attempt.interrupts):]:
            attempt.interrupt(signum)

    def _finish(self, result: AttemptResult) -> int:
        self.status.stop()
        for text in _ending(self, result):
            self._print(text)
        return result.exit_status

    def close(self) -> None:
        """Takes every agent down (their processes with them) and the control server."""
        self.status.stop()
        # Shutdown lets an agent end at once; if it is lost on the way, closing its connection (its
        # stdin) ends the agent just the same, so no need to wait for each one here.
        self._broadcast(pb.LauncherMessage(shutdown=pb.Shutdown()))
        close_agents(self.agents.values(), timeout_s=5.0)
        if self.server is not None:
            self.server.close(grace_s=0.1)
        if self.sink is not None:
            self.sink.close()

    # -- events ------------------------------------------------------------------------------------

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
                    reason = "SSH connection lost"
                if attempt is not None:
                    attempt.host_lost(worker, reason)
            case AgentReport(_, message):
                self._on_report(message)
            case Interrupt():
                pass  # recorded by the signal handler; the event wakes whichever loop is waiting
            case ForwardSignal(signum):
                self._broadcast(pb.LauncherMessage(signal=pb.Signal(signum=signum)))

    def _on_report(self, msg: pb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        attempt = self.attempt
        if kind == "logs":
            if self.sink is not None:
                self.sink.write_batch(msg.logs.lines)
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

    # -- reporting ---------------------------------------------------------------------------------

    def _count_connected(self, worker: int) -> None:
        self.connected += 1

    def _dead_agents(self) -> list[AgentHandle]:
        return [a for w, a in sorted(self.agents.items()) if w not in self.sessions and not a.alive()]

    def _show_status(self) -> None:
        attempt = self.attempt
        self.status.update(hosts=len(self.hosts), connected=self.connected, registered=len(self.sessions),
                           running=attempt.running() if attempt else 0, processes=self.nprocs,
                           attempt=self.restarts.used)

    def _print(self, text: str) -> None:
        self.status.stop()
        lock = self.sink.lock if self.sink is not None else contextlib.nullcontext()
        with lock:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


@contextlib.contextmanager
def _signal_handlers(interrupts: list[int], events: WakeQueue):
    """SIGINT/SIGTERM recorded in `interrupts` (and an Interrupt event to wake the loop); SIGUSR1/2
    queued to be passed on to the job. The previous handlers come back afterwards."""
    def on_signal(signum, frame) -> None:
        interrupts.append(signum)
        events.put(Interrupt(signum))

    def forward(signum, frame) -> None:  # e.g. a checkpoint request for every process
        events.put(ForwardSignal(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous.update({s: signal.signal(s, forward) for s in FORWARDED_SIGNALS})
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_of(e: pb.Exited) -> Exit:
    return Exit(code=e.exit_code, signal=e.signal or None, run_s=e.run_s, tail=tuple(e.tail), error=e.error)


def _port_of(port: concurrent.futures.Future) -> int:
    try:
        return port.result(timeout=SERVER_START_S)
    except concurrent.futures.TimeoutError:
        raise TimeoutError("the control server did not start") from None


def _bootstrap_for(token: str, preflight: tuple[str, str]):
    """`open_agents`' make_bootstrap: each agent's line, once the port it dials is known."""
    def make(worker: int, host, die_with_parent: bool):
        return lambda port: Bootstrap(worker=worker, host=host.address, port=port, token=token,
                                      die_with_parent=die_with_parent, tpu_devices=preflight[0],
                                      libtpu_lockfile=preflight[1]).encode()
    return make


def _ending(sup: Supervisor, result: AttemptResult):
    """What the launcher prints when the job has ended: the table of a failure (or, with -v, a
    summary of a success), then, under --profile, where every host's traces were copied to."""
    if result.outcome is not Outcome.SUCCESS:
        yield ending_table(result)
    elif sup.config.output.verbose:
        yield (f"tpudist: {len(result.states)} processes on {len(sup.hosts)} hosts finished "
               f"in {time.monotonic() - sup.t0:.1f} s")
    if sup.config.procs.profile_dir:
        from tpudist.launch._profile import collect

        yield collect(sup.agents, sup.hosts, sup.job_id, sup.config.procs.profile_dir,
                      timeout_s=sup.config.ssh.connect_timeout).text()
