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
import threading
import time
from collections.abc import Collection

from tpudist.launch._preflight import preflight_paths, refusal
from tpudist.launch._report import version_skew
from tpudist.launch._transport import AgentHandle, open_agents
from tpudist.launch.control import Bootstrap
from tpudist.launch.plan import python_env

SERVER_START_S = 30.0


class LaunchError(Exception):
    """The job could not be started; the message names the hosts and the fix."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) before the processes ran."""


class AgentStartup:
    """CONNECTING and REGISTERING, as methods of `Supervisor` (which holds the state they use:
    config, cluster, hosts, token, events, server, agents, registered, sessions, interrupts)."""

    def _start_server(self, port: concurrent.futures.Future) -> None:
        """Starts the control server; `port` gets its port, or the error, for the agents' side."""
        from tpudist.launch.control._server import ControlServer  # grpc: imported while SSH handshakes run

        try:
            self.server = ControlServer(self.token, self.events, self.job_id)
            self.control_port = self.server.start()
            port.set_result(self.control_port)
        except BaseException as e:
            port.set_exception(e)
            raise

    def _connect(self, workers: Collection[int] | None = None) -> None:
        """CONNECTING: agents start on every host (or on `workers`) while the control server starts here."""
        port: concurrent.futures.Future[int] = concurrent.futures.Future()
        results: dict = {}
        crashed: list[BaseException] = []  # the connecting thread's own failure, raised here
        if self.server is not None:  # a restart: the server runs
            port.set_result(self.control_port)

        def connect() -> None:
            try:
                _open()
            except BaseException as e:  # noqa: BLE001 - re-raised in the launcher's thread below
                crashed.append(e)

        def _open() -> None:
            results.update(open_agents(
                self.cluster, python=python_env(self.config.procs).interpreter,
                make_bootstrap=_bootstrap_for(self.token, preflight_paths(self.config)),
                control_port=lambda: _port_of(port),
                ssh_options=None if self.cluster.local else self.config.ssh,
                on_connected=self._count_connected, poll=lambda: bool(self.interrupts), workers=workers))

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
        """Before a restart: a new agent (and SSH connection) on every host whose agent was lost."""
        lost = sorted(set(range(len(self.hosts))) - self.sessions)
        if not lost:
            return
        from tpudist.launch._transport import close_agents

        close_agents([self.agents.pop(w) for w in lost if w in self.agents], timeout_s=5.0,
                     kill=self.unreported())
        for w in lost:
            self.registered.pop(w, None)
        self._print(f"tpudist: starting a new agent on {', '.join(str(self.hosts[w]) for w in lost)}")
        try:
            self._connect(workers=lost)
            self._await_agents()
        except LaunchError as e:
            raise LaunchError(f"cannot restart the job: {e}") from None

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


def _bootstrap_for(token: str, preflight: tuple[str, str]):
    """`open_agents`' make_bootstrap: each agent's line, once the port it dials is known."""
    def make(worker: int, host, die_with_parent: bool):
        return lambda port: Bootstrap(worker=worker, host=host.address, port=port, token=token,
                                      die_with_parent=die_with_parent, tpu_devices=preflight[0],
                                      libtpu_lockfile=preflight[1]).encode()
    return make
