"""Bringing a job's agents up: the supervisor's CONNECTING and REGISTERING, and again before a restart.

`AgentStartup` is the part of `Supervisor` (supervisor.py) that starts every host's agent: the
control server starts while SSH connects to every host in parallel (_transport.open_agents), then
every agent registers and opens its session within --start-timeout. Before a restart, the hosts
whose agent or SSH connection was lost get a new one the same way (`_reconnect`). A host that cannot
be reached, an agent that dies or never reports, and a busy TPU raise LaunchError naming the hosts.
An agent that never reported (its interpreter hung at startup) is killed, with everything its
command started, when the job closes (`unreported`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Collection

import tpudist._coordinator as _coordinator
from tpudist.launch._preflight import preflight_paths, refusal
from tpudist.launch._report import version_skew
from tpudist.launch._transport import AgentHandle, open_agents
from tpudist.launch.control import Bootstrap
from tpudist.launch.plan import python_env

SERVER_START_S = 30.0


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A host --min-hosts dropped: before which attempt, when (seconds into the job) and why."""

    host: str
    before_attempt: int  # 0-based: the attempt that ran without it first
    at_s: float
    reason: str

    def text(self) -> str:
        return f"{self.host} at {self.at_s:.1f} s, before attempt {self.before_attempt + 1} ({self.reason})"


class LaunchError(Exception):
    """The job could not be started; the message names the hosts and the fix."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) before the processes ran."""


class AgentStartup:
    """CONNECTING and REGISTERING, as methods of `Supervisor` (which holds the state they use:
    config, cluster, hosts, token, events, server, agents, registered, sessions, interrupts, active, dropped, restarts, t0)."""

    @functools.cached_property
    def _tls(self) -> tuple[bytes, bytes]:
        """The control server's key and certificate when agents dial it directly (made once per job)."""
        from tpudist.launch.control._tls import self_signed
        return self_signed()

    def _start_server(self, port: concurrent.futures.Future) -> None:
        """Starts the control server; `port` gets its port, or the error, for the agents' side."""
        from tpudist.launch.control._server import ControlServer  # grpc: imported while SSH handshakes run

        try:
            self.server = ControlServer(self.token, self.events, self.job_id)
            if self.cluster.control_address:  # agents dial it over the network (--ray): TLS, every interface
                self.control_port = self.server.start(bind="[::]" if ":" in self.cluster.control_address
                                                      else "0.0.0.0", tls=self._tls)
            else:
                self.control_port = self.server.start()
            port.set_result(self.control_port)
        except BaseException as e:
            port.set_exception(e)
            raise

    def _connect(self, workers: Collection[int] | None = None, tolerate: bool = False) -> dict[int, Exception]:
        """CONNECTING: agents start on every host (or on `workers`) while the control server starts here.
        A host that cannot be reached raises LaunchError, or with `tolerate` is returned (worker ->
        the error) for the caller to drop."""
        port: concurrent.futures.Future[int] = concurrent.futures.Future()
        results: dict = {}
        crashed: list[BaseException] = []  # the connecting thread's own failure, raised here
        if self.server is not None:  # a restart: the server runs
            port.set_result(self.control_port)

        # made here, not in the connecting thread: the certificate is made once, before the server starts
        make_bootstrap = _bootstrap_for(self.token, preflight_paths(self.config), self.cluster.control_address,
                                        self._tls[1].decode() if self.cluster.control_address else "")

        def connect() -> None:
            try:
                _open()
            except BaseException as e:  # noqa: BLE001 - re-raised in the launcher's thread below
                crashed.append(e)

        def _open() -> None:
            common = dict(python=python_env(self.config.procs).interpreter, make_bootstrap=make_bootstrap,
                          control_port=lambda: _port_of(port), on_connected=self._count_connected,
                          poll=lambda: bool(self.interrupts), workers=workers)
            if self.cluster.ray_nodes:  # --ray: an actor per node starts its agent (tpudist/launch/_ray.py)
                from tpudist.launch._ray import open_ray_agents
                results.update(open_ray_agents(self.cluster, **common))
            else:
                results.update(open_agents(self.cluster, ssh_options=None if self.cluster.local else self.config.ssh,
                                           **common))

        # The local agent dials the server directly, so it must be up first; and the local agent's
        # death signal is tied to the thread that starts it, so it starts here.
        if self.cluster.local:
            if self.server is None:
                self._start_server(port)
            _open()
        else:
            connecting = threading.Thread(target=connect, name="tpudist-connect", daemon=True)
            connecting.start()
            if self.server is None:
                self._start_server(port)
            while connecting.is_alive():  # open_agents has its own deadline
                connecting.join(timeout=0.1)
                self._show_status()
            if crashed:  # not a host's failure (those are results): never wait for agents that cannot come
                raise crashed[0]
        self.agents.update({w: r for w, r in results.items() if not isinstance(r, Exception)})
        self.connected = len(self.agents)
        if self.interrupts:
            raise Interrupted()
        failed = {w: r for w, r in sorted(results.items()) if isinstance(r, Exception)}
        if failed and not tolerate:
            lines = "\n".join(f"  {r}" for r in failed.values())
            raise LaunchError(f"cannot start the job on {len(failed)} of {len(self.hosts)} hosts:\n{lines}")
        return failed

    def _await_agents(self) -> None:
        """REGISTERING: every agent registers and opens its session, within --start-timeout."""
        timeout = self.config.job.start_timeout
        deadline = time.monotonic() + timeout
        want = set(self.active)
        next_liveness = 0.0
        while not (want <= self.sessions and want <= set(self.registered)):
            if self.interrupts:
                raise Interrupted()
            now = time.monotonic()
            if now > deadline:
                raise LaunchError(self._late(timeout, sorted(want - self.sessions)))
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
        if self.attempt is None:  # not again on a restart
            for warning in version_skew({w: r.versions for w, r in self.registered.items()}, self.hosts):
                self._print(warning)
        if busy := refusal({w: r.tpu for w, r in self.registered.items()}, self.hosts):
            raise LaunchError(busy)

    def _late(self, timeout: float, late: list[int]) -> str:
        """The --start-timeout error: which hosts, and what their agent command did meanwhile."""
        hosts = ", ".join(str(self.hosts[w]) for w in late)
        silent = [w for w in late if w not in self.registered and w in self.agents]
        if not silent:
            return f"no agent report within --start-timeout {timeout:g} s from {hosts}"
        python = python_env(self.config.procs).interpreter
        said = "; ".join(f"{self.hosts[w]}: {text}" for w in silent if (text := self.agents[w].stderr_text()))
        return (f"no agent report within --start-timeout {timeout:g} s from {hosts}: the agent command "
                f"({python} -m tpudist.launch.agent) runs there but the agent never reported, so the "
                "interpreter is stuck before it (a slow or hung import, a dead network filesystem?). "
                "What it started there is killed." + (f" It said: {said}" if said else ""))

    def _reconnect(self) -> None:
        """Before a restart: a new agent (and SSH connection) on every host whose agent was lost.

        Under --min-hosts a host that cannot be reached is dropped, and the job goes on over the
        others while at least that many remain; under --rejoin the hosts dropped before are tried
        again, and those that answer are taken back."""
        lost = sorted(set(self.active) - self.sessions)
        back = sorted(self.dropped) if self.config.job.rejoin else []
        if not lost and not back:
            return
        from tpudist.launch._transport import close_agents

        close_agents([self.agents.pop(w) for w in lost if w in self.agents], timeout_s=5.0,
                     kill=self.unreported())
        for w in lost:
            self.registered.pop(w, None)
        elastic = self.config.job.min_hosts is not None
        if lost:
            self._print(f"tpudist: starting a new agent on {', '.join(str(self.hosts[w]) for w in lost)}")
        if back:
            self._print(f"tpudist: --rejoin: trying the dropped hosts {', '.join(str(self.hosts[w]) for w in back)}")
        try:
            failed = self._connect(workers=lost + back, tolerate=elastic)
        except LaunchError as e:
            raise LaunchError(f"cannot restart the job: {e}") from None
        gone = {w: str(e) for w, e in failed.items() if w in lost}
        left = len(self.active) - len(gone) + sum(1 for w in back if w not in failed)
        if gone and left < (self.config.job.min_hosts or 0):
            lines = "\n".join(f"  {e}" for e in gone.values())
            raise LaunchError(f"cannot restart the job: {left} of {len(self.hosts)} hosts would be left, fewer "
                              f"than --min-hosts {self.config.job.min_hosts}; cannot reach again:\n{lines}")
        for w in back:
            if w not in failed:
                del self.dropped[w]
                self.active = sorted([*self.active, w])
                self._print(f"tpudist: --rejoin: {self.hosts[w]} is back; the job runs on it again")
        for w, error in gone.items():
            self._drop(w, error)
        try:
            self._await_agents()
        except LaunchError as e:
            raise LaunchError(f"cannot restart the job: {e}") from None

    def _drop(self, worker: int, reason: str) -> None:
        """--min-hosts: the job goes on without `worker`'s host (said now, and in the summary)."""
        self.active = [w for w in self.active if w != worker]
        self.dropped[worker] = Dropped(self.hosts[worker].address, self.restarts.used, time.monotonic() - self.t0,
                                       reason.splitlines()[0] if reason else "unreachable")
        self._print(f"tpudist: --min-hosts {self.config.job.min_hosts}: dropped {self.hosts[worker]} "
                    f"({self.dropped[worker].reason}); attempt {self.restarts.used + 1} runs on "
                    f"{len(self.active)} of {len(self.hosts)} hosts")

    def dropped_text(self) -> str:
        """The hosts --min-hosts dropped: which, when, why."""
        return "; ".join(d.text() for d in self.dropped.values()) or "none"

    def unreported(self) -> set[int]:
        """Workers whose agent command was started but never registered: nothing there watches it."""
        return {w for w in self.agents if w not in self.registered}

    def _count_connected(self, worker: int) -> None:
        self.connected += 1

    def _dead_agents(self) -> list[AgentHandle]:
        return [a for w, a in sorted(self.agents.items()) if w not in self.sessions and not a.alive()]


def _port_of(port: concurrent.futures.Future) -> int:
    try:
        return port.result(timeout=SERVER_START_S)
    except concurrent.futures.TimeoutError:
        raise TimeoutError("the control server did not start") from None


def _bootstrap_for(token: str, preflight: tuple[str, str], address: str | None = None, tls_cert: str = ""):
    """`open_agents`' make_bootstrap: each agent's line, once the port it dials is known (`address`:
    the launcher's host when agents dial it directly, with the certificate `tls_cert` to trust)."""
    def make(worker: int, host, die_with_parent: bool):
        def line(port: int) -> bytes:
            target = f"{_coordinator._bracket(address)}:{port}" if address else ""
            return Bootstrap(worker=worker, host=host.address, port=port, token=token,
                             die_with_parent=die_with_parent, tpu_devices=preflight[0],
                             libtpu_lockfile=preflight[1], address=target, tls_cert=tls_cert).encode()
        return line
    return make
