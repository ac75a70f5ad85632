"""Running one job: connect, register, then attempts until one ends the job; the I/O around `Attempt`.

The supervisor does the launcher's I/O on its main thread: it starts the agents, runs the control
server, and turns what arrives into calls on the current `Attempt` (the job's state machine, in
attempt.py; the events, in _events.py), then does what the attempt's phase asks:

    CONNECTING   agents start on every host in parallel (_transport.open_agents)
    REGISTERING  every agent registers (versions, its TPU preflight; worker 0 also free ports) and
                 opens its Session; a host whose TPU is busy stops the launch here (_preflight.py);
                 both phases are _startup.py's, which runs them again for hosts lost before a restart
    then, per attempt (`Restarts` decides whether a failed attempt runs again, by its cause):
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

import contextlib
import dataclasses
import os
import secrets
import sys
import time

import tpudist._proc as _proc
from tpudist.launch._events import Event, EventHandling, signal_handlers
from tpudist.launch._goodput import JobGoodput
from tpudist.launch._hang import HangWatch, stacks_table
from tpudist.launch._output import LogSink
from tpudist.launch._report import StartStatus, ending_table, restart_table
from tpudist.launch._startup import AgentStartup, Dropped
from tpudist.launch._transport import AgentHandle, close_agents, reach_address
from tpudist.launch._wake import WakeQueue
from tpudist.launch.attempt import Attempt, AttemptResult, Outcome, Phase, Restarts
from tpudist.launch.config import LaunchConfig
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.plan import ProcessPlan, build_plan, choose_ports, console_is_terminal, processes_per_host
from tpudist.launch.clusters import Cluster

STOP_MARGIN_S = 3.0  # after the grace period: time for SIGKILL and the exit reports to arrive


def process_spec(p: ProcessPlan) -> pb.ProcessSpec:
    """A planned process as the agent's Start carries it: argv and env as bytes."""
    return pb.ProcessSpec(
        rank=p.rank, local_rank=p.local_rank, argv=[os.fsencode(a) for a in p.argv],
        env=[pb.EnvVar(name=os.fsencode(k), value=os.fsencode(v)) for k, v in p.env.items()],
        path_prepend=[os.fsencode(d) for d in p.path_prepend], cwd=os.fsencode(p.cwd),
        conda_env=p.conda_env or "")


class Supervisor(AgentStartup, EventHandling):
    """Runs a job on a resolved cluster: agents, control server, attempts, teardown."""

    def __init__(self, config: LaunchConfig, cluster: Cluster) -> None:
        self.config, self.cluster = config, cluster
        self.hosts = cluster.hosts
        self.job_id = secrets.token_hex(6)
        self.token = secrets.token_urlsafe(32)
        self.events: WakeQueue[Event] = WakeQueue()  # put() is safe in a signal handler
        self.server = None  # the ControlServer, started while the hosts connect
        self.control_port = 0  # its port on 127.0.0.1
        self.agents: dict[int, AgentHandle] = {}
        self.registered: dict[int, pb.RegisterRequest] = {}
        self.sessions: set[int] = set()
        self.active: list[int] = list(range(len(self.hosts)))  # the hosts the job runs on (--min-hosts drops)
        self.dropped: dict[int, Dropped] = {}
        self.connected = 0
        self.attempt: Attempt | None = None
        self.restarts = Restarts(config.job.max_restarts, on=config.job.restart_on)
        self.hangs = HangWatch(config.job.hang_timeout)  # --hang-timeout, SIGQUIT: every rank's stacks
        self.interrupts: list[int] = []  # signal numbers, in order
        self.nprocs = sum(processes_per_host(config.procs, cluster))
        self.console = console_is_terminal(config.output.quiet)  # also asks fit for progress lines
        self.status = StartStatus(enabled=self.console)
        self.sink: LogSink | None = None
        self.goodput = JobGoodput()  # fit's reports from rank 0, for the summary
        self.t0 = time.monotonic()

    # -- the sequence ------------------------------------------------------------------------------

    def run(self) -> int:
        with signal_handlers(self.interrupts, self.events):
            self._connect()
            self._await_agents()
            while True:
                result = self._run_attempt(self._start_attempt())
                if not self.restarts.take(result):
                    return self._finish(result)
                self._print(restart_table(result, self.restarts))
                self._reconnect()  # hosts whose agent or SSH connection was lost

    def _start_attempt(self) -> Attempt:
        first = self.active[0]
        probed = _proc.free_ports(2) if self.cluster.local else list(self.registered[first].free_ports)
        # Over the hosts that are left (--min-hosts): ranks, worker numbers and the coordinator's host
        # are the survivors'; each process's `worker` stays its host's agent, whose Start carries it.
        cluster = self.cluster if not self.dropped else dataclasses.replace(
            self.cluster, hosts=tuple(self.hosts[w] for w in self.active))
        plan = build_plan(self.config.procs, cluster, choose_ports(self.config.job, probed),
                          job_id=self.job_id, attempt=self.restarts.used,
                          coordinator=reach_address(cluster, self.config.ssh),
                          stop_grace=self.config.job.stop_grace, console=self.console)
        plan = [dataclasses.replace(p, worker=self.active[p.worker]) for p in plan]
        self.nprocs = len(plan)
        if self.sink is None:
            out = self.config.output
            self.sink = LogSink(out.log_prefix, plan, ranks=out.ranks, log_dir=out.log_dir, verbose=out.verbose)
            self.sink.before_first_line = self.status.stop
        else:  # a restart over other hosts (--min-hosts, --rejoin) moves ranks
            self.sink.replan(plan)
        self.attempt = Attempt(plan, number=self.restarts.used)
        self.hangs.restart(time.monotonic())
        for worker in self.active:
            specs = [process_spec(p) for p in plan if p.worker == worker]
            if not self.server.send(worker, pb.LauncherMessage(start=pb.Start(
                    attempt=self.attempt.number, processes=specs, grace_s=self.config.job.stop_grace))):
                self.attempt.host_lost(worker, "no control session to start its processes")
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
                self._watch_hangs(attempt)
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

    def _watch_hangs(self, attempt: Attempt) -> None:
        """--hang-timeout and SIGQUIT: every rank's stacks in one table; after a hang, under
        --hang-action stop, the attempt fails with that table as its root cause (tpudist/launch/_hang.py)."""
        now = time.monotonic()
        if self.hangs.due(now):
            self._ask_stacks(f"no rank made progress for {self.hangs.timeout_s:g} s (--hang-timeout)", hang=True)
        done = self.hangs.finished(now)
        if done is None:
            return
        ending = done.hang and self.config.job.hang_action == "stop"
        table, root = stacks_table(attempt.states, done, ending=ending)
        if ending and root is not None:
            attempt.hung(root, table)
        else:
            self._print(f"tpudist: every rank's Python stacks ({done.reason}); the job runs on\n{table}")

    def _ask_stacks(self, reason: str, hang: bool) -> None:
        request = self.hangs.ask(sorted(self.sessions), reason, hang=hang, now=time.monotonic())
        if request is not None:
            self._broadcast(pb.LauncherMessage(stacks=pb.Stacks(request=request)))

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
        close_agents(self.agents.values(), timeout_s=5.0, kill=self.unreported())
        if self.server is not None:
            self.server.close(grace_s=0.1)
        if self.sink is not None:
            self.sink.close()

    # -- reporting ---------------------------------------------------------------------------------

    def _show_status(self) -> None:
        attempt = self.attempt
        self.status.update(hosts=len(self.active), connected=self.connected, registered=len(self.sessions),
                           running=attempt.running() if attempt else 0, processes=self.nprocs,
                           attempt=self.restarts.used)

    def _print(self, text: str) -> None:
        self.status.stop()
        lock = self.sink.lock if self.sink is not None else contextlib.nullcontext()
        with lock:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


def _ending(sup: Supervisor, result: AttemptResult):
    """What the launcher prints when the job has ended: the table of a failure (or, with -v, a
    summary of a success), then, under --profile, where every host's traces were copied to."""
    if result.outcome is not Outcome.SUCCESS:
        yield ending_table(result)
        if refused := sup.restarts.refusal(result):  # --max-restarts asked for more
            yield f"tpudist: {refused}"
    elif result.number and not sup.config.output.quiet:
        yield (f"tpudist: the job succeeded on attempt {result.number + 1}, after {result.number} "
               f"restart{'s' if result.number > 1 else ''}: " + "; ".join(sup.restarts.causes))
    elif sup.config.output.verbose:
        yield (f"tpudist: {len(result.states)} processes on {len(sup.hosts)} hosts finished "
               f"in {time.monotonic() - sup.t0:.1f} s")
    if not sup.config.output.quiet and (goodput := sup.goodput.summary(time.monotonic() - sup.t0)):
        yield goodput
    if sup.dropped and not sup.config.output.quiet:
        yield (f"tpudist: the job ended on {len(sup.active)} of {len(sup.hosts)} hosts; --min-hosts dropped "
               + sup.dropped_text())
    if sup.config.procs.profile_dir:
        from tpudist.launch._profile import collect

        yield collect(sup.agents, sup.hosts, sup.job_id, sup.config.procs.profile_dir,
                      timeout_s=sup.config.ssh.connect_timeout).text()
