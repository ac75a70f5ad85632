"""The agent: registers with the launcher, runs its commands, and never outlives it.

Started as `python -m tpudist.launch.agent` (`__main__.py`). The agent never outlives its launcher:
stdin reaching EOF (the SSH session or the launcher's pipe closed), the control stream breaking
(gRPC keepalive), SIGTERM, or the parent dying (PR_SET_PDEATHSIG) all stop this host's processes
and everything they started (SIGTERM, then SIGKILL) and end the agent. The agent is a child
subreaper, so daemons its processes start (fork, setsid, fork) stay its descendants and are
stopped with them (`_processes.py`). Before registering, it checks that this host's TPU is free
(`_tpucheck.py`) and reports what it found with its registration; the launcher starts nothing
while a host's TPU is busy.
"""

from __future__ import annotations

import os
import queue
import select
import signal
import socket
import sys
import threading
import time

import grpc

import tpudist._proc as _proc
from tpudist.launch._wake import WakeQueue
from tpudist.launch.control import MESSAGE_SIZE_OPTIONS, TLS_NAME, TOKEN_METADATA, Bootstrap
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.control import control_pb2_grpc as pb_grpc
from tpudist.launch.agent import _dump, _tpucheck
from tpudist.launch.agent._gate import Gate
from tpudist.launch.agent._processes import ProcessSet

HEARTBEAT_S = 2.0
# A silently dead launcher (network gone, no stdin EOF, no SIGTERM from the kernel) is noticed within
# KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS.
KEEPALIVE_MS = 5000
KEEPALIVE_TIMEOUT_MS = 10000
ORPHAN_GRACE_S = 2.0  # SIGTERM-to-SIGKILL when the launcher is gone
_VERSIONED = ("jax", "jaxlib", "torch", "tpudist")
_CLOSE = object()
_MAX_BATCH = 512


def read_bootstrap(fd: int, timeout_s: float = 30.0) -> Bootstrap:
    """Reads the launcher's first stdin line without reading past it (the rest is watched for EOF)."""
    data = b""
    end = time.monotonic() + timeout_s
    while not data.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
            raise TimeoutError(f"no bootstrap line from the launcher within {timeout_s:.0f} s")
        chunk = os.read(fd, 1)  # one byte at a time: the line is short and must not over-read
        if not chunk:
            raise EOFError("the launcher closed stdin before sending the bootstrap line")
        data += chunk
    return Bootstrap.decode(data)


def versions() -> dict[str, str]:
    """Python and package versions, from metadata only: importing jax or torch would take seconds.

    The versions are read off the installed `<name>-<version>.dist-info` directory names (one
    directory listing per sys.path entry); importlib.metadata, the fallback for anything else,
    costs ~15-50 ms of imports on every host's agent start-up."""
    found = {"python": "%d.%d.%d" % sys.version_info[:3]}
    wanted = set(_VERSIONED)
    for entry in sys.path:
        if not wanted:
            break
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for dirname in names:
            if dirname.endswith(".dist-info"):
                name, _, version = dirname[:-len(".dist-info")].partition("-")
                if name.lower() in wanted and version:
                    found[name.lower()] = version
                    wanted.discard(name.lower())
    for name in sorted(wanted):
        import importlib.metadata
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


STDIN_CLOSED = "stdin closed: the launcher or its connection is gone"
PARENT_GONE_S = 1.0  # after a SIGTERM or a closed stdin, how long to watch for the parent's death (to say which)
_AGENT_GOING = (STDIN_CLOSED, "SIGTERM", "SIGHUP")  # reasons to end that are the agent's own, not the launcher's


class Ending:
    """How an agent's run ends: the first reason given, from any thread or a signal handler.

    SIGTERM's handler runs on the main thread between two bytecodes, possibly inside the wait
    itself: the wake-up goes through a `WakeQueue`, which takes no lock and keeps its deadline
    (`threading.Event` and `queue.SimpleQueue` each hung here; see `tpudist.launch._wake`)."""

    def __init__(self) -> None:
        self.reason = ""
        self._wake: WakeQueue[str] = WakeQueue()

    def finish(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
        self._wake.put(reason)

    def wait(self, timeout: float) -> bool:
        """Whether the run has ended, after waiting up to `timeout` seconds for it to."""
        if not self.reason:
            try:
                self._wake.get(timeout=timeout)
            except queue.Empty:
                pass
        return bool(self.reason)


class Agent:
    """One host's agent: the control stream to the launcher, and this host's `ProcessSet`."""

    def __init__(self, boot: Bootstrap) -> None:
        self.boot = boot
        self.worker, self.host, self.port = boot.worker, boot.host, boot.port
        self.metadata = ((TOKEN_METADATA, boot.token),)
        self.outbound: queue.Queue = queue.Queue()
        self.procs = ProcessSet(self.worker, self.outbound.put)
        self.procs.debug_root = _dump.make_root()  # each process's stacks and progress (hang reports)
        # A multi-host job's JAX coordinator, reached only by the job's hosts (_gate.py).
        self.gate = Gate(boot.token, host=self.host, say=self._say)
        self.first_rank = 0  # this host's lowest rank: whose output the gate's lines appear in
        self.ending = Ending()
        self.child_ended = False  # SIGCHLD: an orphan re-parented to this agent may need reaping
        self.parent = os.getppid()
        self.stream_done = threading.Event()  # the control stream's responses ended (or broke)

    def finish(self, reason: str) -> None:
        """Ends the run (any thread, or a signal handler: see Ending)."""
        self.ending.finish(reason)

    def run(self) -> int:
        threading.Thread(target=self._watch_stdin, daemon=True).start()
        options = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                   *MESSAGE_SIZE_OPTIONS]
        if self.boot.tls_cert:  # dialled over the network (--ray): trust the job's own certificate alone
            channel = grpc.secure_channel(self.boot.target(), grpc.ssl_channel_credentials(
                root_certificates=self.boot.tls_cert.encode()), options=[
                    *options, ("grpc.ssl_target_name_override", TLS_NAME)])
        else:  # 127.0.0.1: the SSH tunnel's end on this host, or the launcher's own machine
            channel = grpc.insecure_channel(self.boot.target(), options=options)
        try:
            stub = pb_grpc.ControlStub(channel)
            # Register and open the Session together: one round trip through the tunnel, not two.
            registered = stub.Register.future(pb.RegisterRequest(
                worker=self.worker, host=self.host, hostname=socket.gethostname(), versions=versions(),
                free_ports=_proc.free_ports(2), pid=os.getpid(),
                tpu=self._check_tpu()),
                metadata=self.metadata, timeout=30, wait_for_ready=True)
            responses = stub.Session(self._requests(), metadata=self.metadata, wait_for_ready=True)
            threading.Thread(target=self._serve, args=(responses,), daemon=True).start()
            registered.result()
            while not self.ending.wait(0.5):  # the main thread stays free for signal handlers
                if self.child_ended:
                    self.child_ended = False
                    self.procs.reap()
        finally:
            if self.ending.reason in _AGENT_GOING:
                # This agent is going by itself (its parent, its stdin or a signal): say why and end
                # the session first, so that the launcher counts the host as lost instead of blaming
                # the SIGTERM its processes get next (over SSH the tunnel is usually gone already).
                self.outbound.put(pb.AgentMessage(worker=self.worker, goodbye=pb.Goodbye(reason=self._going())))
                self.outbound.put(_CLOSE)
                self.stream_done.wait(1.0)  # the launcher read it and ended the call: nothing is dropped
                channel.close()
            self._teardown()
            self.outbound.put(_CLOSE)
            channel.close()
        return 0

    def _going(self) -> str:
        """Why this agent ends by itself, as the launcher says it."""
        # Its parent's death signal comes when the parent's *thread* that started it exits, and a killed
        # parent's end of the stdin pipe closes, before the process is gone: give the rest of it a moment.
        waits = self.ending.reason in ("SIGTERM", STDIN_CLOSED)
        deadline = time.monotonic() + (PARENT_GONE_S if waits else 0.0)
        while os.getppid() == self.parent and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.getppid() != self.parent:
            return "its parent died (the SSH session or the Ray actor that started it)"
        if self.ending.reason == STDIN_CLOSED:
            return "its stdin closed (the launcher's connection to it is gone)"
        return f"{self.ending.reason} to the agent"

    def _check_tpu(self) -> pb.TpuCheck:
        if not self.boot.tpu_devices:
            return pb.TpuCheck()
        found = _tpucheck.check(self.boot.tpu_devices, self.boot.libtpu_lockfile)
        return pb.TpuCheck(checked=found.checked, devices=found.devices, unreadable=found.unreadable,
                           problems=[pb.TpuProblem(**p._asdict()) for p in found.problems])

    def _watch_stdin(self) -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        self.finish(STDIN_CLOSED)

    def _serve(self, responses) -> None:
        try:
            for msg in responses:
                kind = msg.WhichOneof("kind")
                if kind == "start":
                    self._start(msg.start)
                elif kind == "signal":
                    self.procs.signal(msg.signal.signum)
                elif kind == "stop":
                    self.procs.stop(msg.stop.grace_s)
                elif kind == "stacks":  # on a thread: the dumps take up to a few seconds
                    threading.Thread(target=self._send_stacks, args=(msg.stacks.request,), daemon=True).start()
                elif kind == "shutdown":
                    return self.finish("shutdown")
            self.finish("the launcher ended the control stream")
        except grpc.RpcError as e:
            self.finish(f"control stream lost: {e.code().name}")
        finally:
            self.stream_done.set()

    def _send_stacks(self, request: int) -> None:
        ranks = _dump.collect(self.procs.debug_targets())
        report = pb.StacksReport(request=request, ranks=ranks)
        self.outbound.put(pb.AgentMessage(worker=self.worker, stacks=report))

    def _requests(self):
        yield pb.AgentMessage(worker=self.worker, hello=pb.Hello())
        pending = None
        while True:
            item = pending if pending is not None else self._next()
            pending = None
            if item is _CLOSE:
                return
            if isinstance(item, pb.LogLine):  # batch whatever lines are already waiting
                lines = [item]
                while len(lines) < _MAX_BATCH:
                    try:
                        nxt = self.outbound.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(nxt, pb.LogLine):
                        pending = nxt
                        break
                    lines.append(nxt)
                item = pb.AgentMessage(worker=self.worker, logs=pb.Logs(lines=lines))
            yield item

    def _next(self):
        try:
            return self.outbound.get(timeout=HEARTBEAT_S)
        except queue.Empty:
            progress = _dump.progress_total([d for _, _, d in self.procs.debug_targets()])
            return pb.AgentMessage(worker=self.worker, heartbeat=pb.Heartbeat(progress=progress))

    def _start(self, start: pb.Start) -> None:
        """The attempt's coordinator gate, then its processes; a gate that cannot open fails them all."""
        self.first_rank = min((p.rank for p in start.processes), default=0)
        try:
            self.gate.configure(start)
        except RuntimeError as e:
            for spec in start.processes:
                self.outbound.put(pb.AgentMessage(worker=self.worker, exited=pb.Exited(
                    rank=spec.rank, exit_code=1, attempt=start.attempt, error=str(e))))
            return
        self.procs.start(start)

    def _say(self, line: str) -> None:
        self.outbound.put(pb.LogLine(rank=self.first_rank, stream=pb.STDERR, data=line.encode()))

    def _teardown(self) -> None:
        self.gate.close()
        self.procs.end(ORPHAN_GRACE_S)  # every process and descendant: SIGTERM, grace, SIGKILL
        _dump.remove_root(self.procs.debug_root)
        if self.ending.reason != "shutdown":
            try:
                print(f"tpudist agent on {self.host}: {self.ending.reason}; stopped this host's processes",
                      file=sys.stderr, flush=True)
            except OSError:  # the launcher, which reads this, may be gone
                pass


def main() -> int:
    boot = read_bootstrap(0)
    if boot.die_with_parent:
        _proc.set_parent_death_signal(signal.SIGTERM)  # sshd's session, or the launcher
        if os.getppid() == 1:  # the parent died before the request took effect
            return 1
    _proc.become_subreaper()
    agent = Agent(boot)
    signal.signal(signal.SIGCHLD, lambda *_: setattr(agent, "child_ended", True))
    signal.signal(signal.SIGTERM, lambda *_: agent.finish("SIGTERM"))
    signal.signal(signal.SIGHUP, lambda *_: agent.finish("SIGHUP"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the launcher, which stops us
    return agent.run()


def run_main() -> None:
    """Runs the agent and ends its process."""
    code = main()
    sys.stderr.flush()
    os._exit(code)  # the processes are stopped and the channel closed: skip the interpreter's teardown
