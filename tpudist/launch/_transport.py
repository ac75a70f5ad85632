"""Starting the per-host agents: over SSH, in parallel with a bounded fan-out, or as a local process.

The only shell strings ever run on a host are the fixed agent command,
`echo $$; exec '<python>' -m tpudist.launch.agent`, with the interpreter path shell-quoted, and,
for an agent that never reported, `kill -KILL -- -<its pid>`. Everything else
(the control port, the job token, later the processes' argv and env) travels as data: the bootstrap
line on the agent's stdin (`tpudist.launch.control.Bootstrap`), then the gRPC control plane.

`open_agents` returns one result per worker, an `AgentHandle` or the exception that host raised:
partial failure is data, and the caller decides (the supervisor closes everything and names the hosts).

    results = open_agents(cluster, python="/usr/bin/python3", make_bootstrap=bootstrap,
                          control_port=lambda: server_port, ssh_options=SshOptions(fanout=64))
    failed = {w: r for w, r in results.items() if isinstance(r, Exception)}
"""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable

from tpudist.launch.config import SshOptions
from tpudist.launch.plan import coordinator_host
from tpudist.launch.clusters import Cluster, Host

AGENT_MODULE = "tpudist.launch.agent"


def agent_command(python: str) -> str:
    """The fixed shell command that starts the agent on a host. It first prints its pid, which is its
    process group's (sshd starts each command in a session of its own): an interpreter that hangs
    before the agent's own watchdogs run is killed through it (`SshAgent.kill`)."""
    return f"echo $$; exec {shlex.quote(python)} -m {AGENT_MODULE}"


def kill_command(pid: int) -> str:
    """SIGKILL to the process group an agent command started (or, failing that, to its pid)."""
    assert isinstance(pid, int) and pid > 1
    return f"kill -KILL -- -{pid} 2>/dev/null || kill -KILL {pid}"


def reach_address(cluster: Cluster, ssh: SshOptions) -> str:
    """The address of rank 0's host for every process: internal IP, else ~/.ssh/config's HostName."""
    if cluster.local or cluster.hosts[0].internal_ip:
        return coordinator_host(cluster)
    from tpudist.launch import _ssh

    return coordinator_host(cluster, _ssh.resolve(cluster.hosts[0], ssh, ssh.config()).hostname)


class AgentHandle:
    """One started agent: whether it exited, what it said on stderr, and closing it."""

    worker: int
    host: Host
    LOST = "SSH connection lost"  # what exit status -1 means for this kind of agent

    def exit_status(self) -> int | None:
        raise NotImplementedError

    def stderr_text(self) -> str:
        raise NotImplementedError

    def alive(self) -> bool:
        return self.exit_status() is None

    def describe_failure(self, python: str) -> str:
        """Why this agent ended before registering, naming the host and the fix."""
        code = self.exit_status()
        said = self.stderr_text()
        if code == -1:
            return f"host {self.host}: the SSH connection closed before the agent reported. {said}".strip()
        hint = ""
        if code == 127:
            hint = (f" The interpreter {python} is missing on that host; give one that has tpudist with "
                    "--python PATH or --venv PATH.")
        elif "No module named" in said and "tpudist" in said:
            hint = f" tpudist is not installed for {python} on that host; install it there or pass --python/--venv."
        return f"host {self.host}: the agent exited with status {code} before registering.{hint}\n    {said}"

    def close(self) -> None:
        """Closes the agent's stdin and connection; an agent still running then stops by itself."""
        raise NotImplementedError

    def kill(self, timeout_s: float) -> None:
        """SIGKILL to everything the agent command started, for an agent that never reported (its
        interpreter hung at startup, before the agent could watch its stdin or its parent)."""
        raise NotImplementedError


class _StderrTail:
    """Keeps the last bytes an agent wrote to stderr."""

    def __init__(self, limit: int = 8192) -> None:
        self.data = b""
        self.limit = limit

    def add(self, chunk: bytes) -> None:
        self.data = (self.data + chunk)[-self.limit:]

    def text(self) -> str:
        return self.data.decode(errors="replace").strip()


class LocalAgent(AgentHandle):
    """The agent as a child process of the launcher (--local): same protocol, no SSH."""

    def __init__(self, worker: int, host: Host, python: str, make_bootstrap: Callable[[int], bytes],
                 control_port: Callable[[], int]) -> None:
        self.worker, self.host = worker, host
        self._tail = _StderrTail()
        # Its own session: Ctrl-C in the terminal reaches only the launcher, which then stops the job.
        self.proc = subprocess.Popen([python, "-m", AGENT_MODULE], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._drain, daemon=True).start()
        assert self.proc.stdin is not None
        self.proc.stdin.write(make_bootstrap(control_port()))
        self.proc.stdin.flush()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(4096):
            self._tail.add(chunk)

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def stderr_text(self) -> str:
        return self._tail.text()

    def kill(self, timeout_s: float) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group is its pid
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class SshAgent(AgentHandle):
    """The agent on a remote host, on an exec channel of that host's single SSH connection."""

    def __init__(self, worker: int, host: Host, client, python: str,
                 make_bootstrap: Callable[[int], bytes], control_port: Callable[[], int], timeout_s: float) -> None:
        from tpudist.launch._ssh import forward_control_port

        self.worker, self.host, self.client = worker, host, client
        self._tail = _StderrTail()
        remote_port = forward_control_port(client, control_port)
        transport = client.get_transport()
        self.channel = transport.open_session(timeout=timeout_s)
        self.channel.exec_command(agent_command(python))
        try:
            self.channel.sendall(make_bootstrap(remote_port))
        except OSError:
            # The command may have ended already (no such interpreter: status 127) and closed the
            # channel; then its exit status and stderr, which the supervisor reports, say why.
            deadline = time.monotonic() + 2.0
            while not self.channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            if not self.channel.exit_status_ready():
                raise

    def exit_status(self) -> int | None:
        if self.channel.exit_status_ready():
            return self.channel.recv_exit_status()
        transport = self.client.get_transport()
        return None if transport is not None and transport.is_active() else -1

    def stderr_text(self) -> str:
        while self.channel.recv_stderr_ready():
            self._tail.add(self.channel.recv_stderr(4096))
        return self._tail.text()

    def _remote_pid(self, timeout_s: float) -> int | None:
        """The pid the agent command printed first on its stdout (nothing else writes there)."""
        data = b""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in data and time.monotonic() < deadline and not self.channel.closed:
            if self.channel.recv_ready():
                data += self.channel.recv(64)
            else:
                time.sleep(0.01)
        first = data.split(b"\n", 1)[0].strip()
        return int(first) if first.isdigit() and int(first) > 1 else None

    def kill(self, timeout_s: float) -> None:
        import paramiko

        transport = self.client.get_transport()
        pid = self._remote_pid(timeout_s)
        if pid is None or transport is None or not transport.is_active():
            return  # the connection is gone: sshd closed the command's pipes, nothing more can be done
        try:
            killer = transport.open_session(timeout=timeout_s)
            killer.exec_command(kill_command(pid))
            deadline = time.monotonic() + timeout_s
            while not killer.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            killer.close()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def close(self) -> None:
        try:
            self.channel.shutdown_write()  # stdin EOF: the agent stops its processes and exits
        except (OSError, EOFError):
            pass
        self.client.close()


def close_agents(agents: Iterable[AgentHandle], timeout_s: float, kill: Collection[int] = ()) -> None:
    """Closes every agent at once (each stops its processes by itself); waits at most `timeout_s`.
    The agents of the workers in `kill` (those that never reported) are SIGKILLed first, with what
    their command started."""
    def end(agent: AgentHandle) -> None:
        if agent.worker in kill:
            agent.kill(timeout_s / 2)
        agent.close()

    closers = [threading.Thread(target=end, args=(a,), daemon=True) for a in agents]
    for t in closers:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in closers:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


def open_agents(cluster: Cluster, *, python: str, make_bootstrap: Callable[[int, Host, bool], Callable],
                control_port: Callable[[], int], ssh_options: SshOptions | None = None,
                on_connected: Callable[[int], None] = lambda w: None,
                poll: Callable[[], bool] = lambda: False,
                workers: Collection[int] | None = None) -> dict[int, AgentHandle | Exception]:
    """Starts one agent per host (only on `workers`, if given), at most `ssh_options.fanout` SSH
    handshakes at once.

    `poll()` is called from the calling thread every 0.2 s; returning True cancels the hosts still
    connecting. `on_connected(worker)` is called from a connecting thread.

    `make_bootstrap(worker, host, die_with_parent)` returns a function of the control port the agent
    dials (the forwarded port on that host) giving its bootstrap line. `control_port()` returns the
    launcher's control server port; SSH agents only need it once they dial, so the server may start
    while the hosts connect.
    """
    if cluster.local:
        host = cluster.hosts[0]
        return {0: LocalAgent(0, host, python, make_bootstrap(0, host, True), control_port)}

    from tpudist.launch import _ssh

    opts = ssh_options or SshOptions()
    fanout = opts.fanout
    config = opts.config()
    clients: dict[int, object] = {}
    lock = threading.Lock()
    abandoned = threading.Event()  # set when the caller stops waiting: late connections close themselves

    def start(worker: int, host: Host) -> AgentHandle:
        client = _ssh.connect(host, opts, config)
        with lock:
            if abandoned.is_set():
                client.close()
                raise _ssh.SshError(f"host {host}: abandoned")
            clients[worker] = client
        on_connected(worker)
        try:
            # die_with_parent: the agent's parent is this host's sshd session, gone with the connection.
            agent = SshAgent(worker, host, client, python, make_bootstrap(worker, host, True), control_port,
                             opts.connect_timeout)
        except Exception as e:
            client.close()
            if isinstance(e, _ssh.SshError):
                raise _ssh.SshError(f"host {host}: {e}") from None
            raise _ssh.SshError(f"host {host}: cannot start the agent: {e}") from None
        with lock:
            if abandoned.is_set():
                agent.close()
                raise _ssh.SshError(f"host {host}: abandoned")
        return agent

    results: dict[int, AgentHandle | Exception] = {}
    hosts = {w: h for w, h in enumerate(cluster.hosts) if workers is None or w in workers}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(fanout, len(hosts))),
                                                 thread_name_prefix="tpudist-ssh")
    futures = {pool.submit(start, w, h): w for w, h in hosts.items()}
    # Each handshake step has its own timeout; this bound covers a host stuck between steps.
    deadline = time.monotonic() + opts.connect_timeout * (3 + len(hosts) / fanout)
    pending = set(futures)
    cancelled = False
    while pending and time.monotonic() < deadline and not cancelled:
        done, pending = concurrent.futures.wait(pending, timeout=0.2)
        for f in done:
            try:
                results[futures[f]] = f.result()
            except Exception as e:  # noqa: BLE001 - per-host failure is data
                results[futures[f]] = e
        cancelled = poll()
    with lock:
        abandoned.set()
    for f in pending:
        worker = futures[f]
        f.cancel()
        client = clients.get(worker)
        if client is not None:
            client.close()
        results[worker] = _ssh.SshError(f"host {cluster.hosts[worker]}: "
                                        + ("cancelled" if cancelled else "timed out starting the agent"))
    pool.shutdown(wait=False, cancel_futures=True)
    return results
