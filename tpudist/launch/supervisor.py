"""Running one job: connect, register, start, supervise, stop; restart under --max-restarts.

The supervisor is one visible sequence of named states on the launcher's main thread:

    CONNECTING   agents start on every host in parallel (transport.open_agents)
    REGISTERING  every agent registers (versions; worker 0 also free ports) and opens its Session
    STARTING     the plan of this attempt is sent, one Start per host
    RUNNING      lines are printed, exits recorded; the first failure, a lost host or Ctrl-C ends it
    STOPPING     SIGTERM to every process group, a grace period, then SIGKILL; wait for every exit

Anything that goes wrong before RUNNING raises LaunchError naming the hosts; `close()` always takes
every agent down, so nothing of the job is left running anywhere.

    sup = Supervisor(args, cluster)
    try:
        code = sup.run()
    finally:
        sup.close()
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import secrets
import signal
import sys
import threading
import time

from tpudist.launch import control_pb2 as pb
from tpudist.launch._cluster import Cluster
from tpudist.launch._output import LogSink
from tpudist.launch._report import ProcState, StartStatus, failure_table
from tpudist.launch._ports import free_ports
from tpudist.launch.plan import (ProcessPlan, build_plan, choose_ports, coordinator_host, processes_per_host,
                                 python_env)
from tpudist.launch.transport import AgentHandle, bootstrap_line, open_agents

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # passed on to every process group of the job
STOP_MARGIN_S = 3.0  # after the grace period: time for SIGKILL and the exit reports to arrive


class LaunchError(Exception):
    """The job could not be started; the message names the hosts and the fix."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) before the processes ran."""


def ssh_options(args: argparse.Namespace):
    from tpudist.launch._ssh import SshOptions

    return SshOptions(user=args.ssh_user, port=args.ssh_port, key=args.ssh_key, known_hosts=args.known_hosts,
                      accept_new=args.accept_new_host_keys, connect_timeout=args.connect_timeout,
                      config_path=args.ssh_config)


def reach_address(args: argparse.Namespace, cluster: Cluster) -> str:
    """The address of rank 0's host for every process: internal IP, else ~/.ssh/config's HostName."""
    if cluster.local or cluster.hosts[0].internal_ip:
        return coordinator_host(cluster)
    from tpudist.launch import _ssh

    opts = ssh_options(args)
    return coordinator_host(cluster, _ssh.resolve(cluster.hosts[0], opts, opts.config()).hostname)


def _spec(p: ProcessPlan) -> pb.ProcessSpec:
    return pb.ProcessSpec(
        rank=p.rank, local_rank=p.local_rank, argv=[os.fsencode(a) for a in p.argv],
        env=[pb.EnvVar(name=os.fsencode(k), value=os.fsencode(v)) for k, v in p.env.items()],
        path_prepend=[os.fsencode(d) for d in p.path_prepend], cwd=os.fsencode(p.cwd),
        conda_env=p.conda_env or "")


class Supervisor:
    def __init__(self, args: argparse.Namespace, cluster: Cluster) -> None:
        self.args, self.cluster = args, cluster
        self.hosts = cluster.hosts
        self.job_id = secrets.token_hex(6)
        self.token = secrets.token_urlsafe(32)
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in a signal handler
        self.server = None  # the ControlServer, started while the hosts connect
        self.agents: dict[int, AgentHandle] = {}
        self.registered: dict[int, pb.RegisterRequest] = {}
        self.sessions: set[int] = set()
        self.connected = 0
        self.states: list[ProcState] = []
        self.root: int | None = None  # rank of the first observed failure of this attempt
        self.attempt = 0
        self.interrupts: list[int] = []  # signal numbers, in order
        self.nprocs = sum(processes_per_host(args, cluster))
        tty = sys.stderr.isatty() and sys.stdout.isatty()
        self.status = StartStatus(enabled=tty and not args.quiet)
        self.sink: LogSink | None = None
        self.t0 = time.monotonic()

    # -- the sequence ------------------------------------------------------------------------------

    def run(self) -> int:
        with self._signal_handlers():
            self._connect()
            self._await_agents()
            while True:
                self._start_attempt()
                outcome, root = self._supervise()
                if outcome != "success":
                    outcome = self._stop_all(outcome)
                if outcome == "failure" and self.attempt < self.args.max_restarts and not self.interrupts:
                    self._print(failure_table(self.states, root, headline=(
                        f"tpudist: attempt {self.attempt + 1} failed; restarting "
                        f"({self.attempt + 1}/{self.args.max_restarts} restarts)")))
                    self.attempt += 1
                    continue
                return self._finish(outcome, root)

    def _start_server(self) -> int:
        from tpudist.launch.control import ControlServer  # grpc: imported while SSH handshakes run

        self.server = ControlServer(self.token, self.events, self.job_id)
        return self.server.start()

    def _connect(self) -> None:
        """CONNECTING: agents start on every host while the control server starts here."""
        port = _Promise()
        if self.cluster.local:  # the local agent dials the server directly: it must be up first
            port.set(self._start_server())

        def bootstrap(worker, host, die_with_parent):
            return lambda agent_port: bootstrap_line(worker=worker, host=host.address, port=agent_port,
                                                     token=self.token, die_with_parent=die_with_parent)

        def connected(worker: int) -> None:
            self.connected += 1

        results: dict = {}

        def connect() -> None:
            results.update(open_agents(
                self.cluster, python=python_env(self.args).interpreter, make_bootstrap=bootstrap,
                control_port=port.get, ssh_options=None if self.cluster.local else ssh_options(self.args),
                fanout=self.args.fanout, on_connected=connected, poll=lambda: bool(self.interrupts)))

        # The local agent's death signal is tied to the thread that starts it, so it starts here.
        if self.cluster.local:
            connect()
        else:
            connecting = threading.Thread(target=connect, name="tpudist-connect", daemon=True)
            connecting.start()
            port.set(self._start_server())
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
        deadline = time.monotonic() + self.args.start_timeout
        want = set(range(len(self.hosts)))
        next_liveness = 0.0
        while not (want <= self.sessions and want <= set(self.registered)):
            if self.interrupts:
                raise Interrupted()
            now = time.monotonic()
            if now > deadline:
                late = sorted(want - self.sessions)
                raise LaunchError(f"no agent report within --start-timeout {self.args.start_timeout:g} s from "
                                  + ", ".join(str(self.hosts[w]) for w in late))
            # Every agent's SSH channel, a few times a second: each report wakes this loop, and
            # checking all of them on every wake-up was ~10% of the launcher's Python time at 64 hosts.
            if now >= next_liveness:
                next_liveness = now + 0.2
                if self._dead_agents():
                    time.sleep(0.5)  # the same problem usually hits every host: name them all at once
                    raise LaunchError("\n".join(self._agent_failure(w, a) for w, a in self._dead_agents()))
            self._drain(timeout=0.1)
            self._show_status()
        self._warn_version_skew()

    def _start_attempt(self) -> None:
        if self.cluster.local:
            probed = free_ports(2)
        else:
            probed = list(self.registered[0].free_ports)
        ports = choose_ports(self.args, probed)
        plan = build_plan(self.args, self.cluster, ports, job_id=self.job_id, attempt=self.attempt,
                          coordinator=reach_address(self.args, self.cluster))
        if self.sink is None:
            self.sink = LogSink(self.args.log_prefix, plan, ranks=self.args.ranks, log_dir=self.args.log_dir)
            self.sink.before_first_line = self.status.stop
        self.states = [ProcState(p) for p in plan]
        self.root = None
        for worker in range(len(self.hosts)):
            specs = [_spec(p) for p in plan if p.worker == worker]
            self.server.send(worker, pb.LauncherMessage(start=pb.Start(attempt=self.attempt, processes=specs)))

    def _supervise(self) -> tuple[str, int | None]:
        """RUNNING: returns ("success" | "failure" | "interrupted", root cause rank)."""
        while True:
            if self.interrupts:
                return "interrupted", None
            if self.root is not None:
                return "failure", self.root
            if all(s.done for s in self.states):
                return "success", None
            self._drain(timeout=0.2)
            self._show_status()

    def _stop_all(self, outcome: str) -> str:
        """STOPPING: SIGTERM, grace, SIGKILL on every host; waits for every process's exit."""
        grace = self.args.stop_grace
        for s in self.states:
            if not s.done:
                s.stopping = True
        hard = len(self.interrupts) >= 2
        self._broadcast(pb.LauncherMessage(stop=pb.Stop(grace_s=0.0 if hard else grace)))
        deadline = time.monotonic() + (0 if hard else grace) + STOP_MARGIN_S
        while not all(s.done for s in self.states) and time.monotonic() < deadline:
            if len(self.interrupts) >= 2 and not hard:  # a second Ctrl-C: kill at once
                hard = True
                self._broadcast(pb.LauncherMessage(stop=pb.Stop(grace_s=0.0)))
                deadline = min(deadline, time.monotonic() + 1.5)
            self._drain(timeout=0.1)
        for s in self.states:
            if not s.done:
                s.lost = "did not report its exit in time"
        return "interrupted" if self.interrupts else outcome

    def _finish(self, outcome: str, root: int | None) -> int:
        self.status.stop()
        if outcome == "success":
            if self.args.verbose:
                self._print(f"tpudist: {len(self.states)} processes on {len(self.hosts)} hosts finished "
                            f"in {time.monotonic() - self.t0:.1f} s")
            return 0
        if outcome == "interrupted":
            sig = self.interrupts[0]
            self._print(failure_table(self.states, None, headline=(
                f"tpudist: stopped by {signal.Signals(sig).name}; every process was stopped")))
            return 128 + sig
        rootstate = next(s for s in self.states if s.plan.rank == root)
        self._print(failure_table(self.states, root, headline=(
            "tpudist: the job failed; every other process was stopped"
            + (f" (attempt {self.attempt + 1})" if self.attempt else ""))))
        return rootstate.exit_status()

    def close(self) -> None:
        """Takes every agent down (their processes with them) and the control server."""
        self.status.stop()
        # Shutdown lets an agent end at once; if it is lost on the way, closing its connection (its
        # stdin) ends the agent just the same, so no need to wait for each one here.
        self._broadcast(pb.LauncherMessage(shutdown=pb.Shutdown()))
        closers = [threading.Thread(target=a.close, daemon=True) for a in self.agents.values()]
        for t in closers:
            t.start()
        deadline = time.monotonic() + 5.0
        for t in closers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.server is not None:
            self.server.close(grace_s=0.1)
        if self.sink is not None:
            self.sink.close()

    # -- events ------------------------------------------------------------------------------------

    def _drain(self, timeout: float) -> None:
        """Handles every event that arrives within `timeout` (at least waits for one)."""
        try:
            item = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, worker: int, payload) -> None:
        if kind == "registered":
            self.registered[worker] = payload
        elif kind == "session":
            self.sessions.add(worker)
        elif kind == "lost":
            self.sessions.discard(worker)
            agent = self.agents.get(worker)
            reason = "SSH connection lost" if agent is not None and agent.exit_status() == -1 else payload
            for s in self.states:
                if s.plan.worker == worker and not s.done:
                    s.lost = f"host agent gone: {reason}"
                    self._note_failure(s)
        elif kind == "message":
            self._on_message(payload)
        elif kind == "forward":
            self._broadcast(pb.LauncherMessage(signal=pb.Signal(signum=payload)))

    def _on_message(self, msg: pb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "logs":
            if self.sink is not None:
                self.sink.write_batch(msg.logs.lines)
        elif kind == "started" and msg.started.attempt == self.attempt:
            self.states[msg.started.rank].pid = msg.started.pid
            if all(s.pid or s.done for s in self.states):
                self.status.stop()
        elif kind == "exited" and msg.exited.attempt == self.attempt:
            e = msg.exited
            s = self.states[e.rank]
            s.exit_code, s.signal, s.run_s = e.exit_code, e.signal or None, e.run_s
            s.tail, s.error = list(e.tail), e.error
            if s.signal is None and not e.exit_code:
                s.exit_code = 0
            self._note_failure(s)

    def _note_failure(self, s: ProcState) -> None:
        if s.failed and self.root is None and not s.stopping:
            self.root = s.plan.rank

    def _broadcast(self, msg: pb.LauncherMessage) -> None:
        if self.server is not None:
            for worker in list(self.sessions):
                self.server.send(worker, msg)

    # -- reporting ---------------------------------------------------------------------------------

    def _dead_agents(self) -> list[tuple[int, AgentHandle]]:
        return [(w, a) for w, a in sorted(self.agents.items()) if w not in self.sessions and not a.alive()]

    def _agent_failure(self, worker: int, agent: AgentHandle) -> str:
        code = agent.exit_status()
        said = agent.stderr_text()
        python = python_env(self.args).interpreter
        host = self.hosts[worker]
        if code == -1:
            return f"host {host}: the SSH connection closed before the agent reported. {said}".strip()
        hint = ""
        if code == 127:
            hint = (f" The interpreter {python} is missing on that host; give one that has tpudist with "
                    "--python PATH or --venv PATH.")
        elif "No module named" in said and "tpudist" in said:
            hint = f" tpudist is not installed for {python} on that host; install it there or pass --python/--venv."
        return f"host {host}: the agent exited with status {code} before registering.{hint}\n    {said}"

    def _warn_version_skew(self) -> None:
        by_package: dict[str, dict[str, list[int]]] = {}
        for worker, req in self.registered.items():
            names = set(req.versions) | {"jax", "torch", "tpudist"}
            for name in names:
                by_package.setdefault(name, {}).setdefault(req.versions.get(name, "missing"), []).append(worker)
        for name, seen in sorted(by_package.items()):
            if len(seen) > 1:
                detail = "; ".join(f"{v} on {', '.join(self.hosts[w].address for w in sorted(ws)[:4])}"
                                   + (f" (+{len(ws) - 4} more)" if len(ws) > 4 else "")
                                   for v, ws in sorted(seen.items()))
                self._print(f"tpudist: warning: {name} versions differ across hosts: {detail}")

    def _show_status(self) -> None:
        self.status.update(hosts=len(self.hosts), connected=self.connected, registered=len(self.sessions),
                           running=sum(1 for s in self.states if s.pid and not s.done),
                           processes=self.nprocs, attempt=self.attempt)

    def _print(self, text: str) -> None:
        self.status.stop()
        lock = self.sink.lock if self.sink is not None else contextlib.nullcontext()
        with lock:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    @contextlib.contextmanager
    def _signal_handlers(self):
        def on_signal(signum, frame) -> None:
            self.interrupts.append(signum)
            self.events.put(("interrupt", -1, signum))

        def forward(signum, frame) -> None:  # e.g. a checkpoint request for every process
            self.events.put(("forward", -1, signum))

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        previous.update({s: signal.signal(s, forward) for s in FORWARDED_SIGNALS})
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class _Promise:
    """A value one thread sets and others wait for (the control server's port)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value = 0

    def set(self, value: int) -> None:
        self._value = value
        self._event.set()

    def get(self, timeout_s: float = 30.0) -> int:
        if not self._event.wait(timeout_s):
            raise TimeoutError("the control server did not start")
        return self._value
