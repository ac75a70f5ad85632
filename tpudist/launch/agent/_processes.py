"""The agent's side of a job: one host's processes, their output, their exits, and their leftovers.

Each process runs in its own session (so its own process group). The agent is a child subreaper
(`_proc.become_subreaper`), so whatever a process starts stays the agent's descendant even after
it leaves the group and session (a daemon): stopping the job (`stop`, `end`) signals every process
group and every other descendant, SIGTERM, a grace period, SIGKILL. When one process ends, what it
left behind, its group and the orphans that carry its RANK, is stopped the same way.

Every stdout/stderr line becomes a `LogLine` event; the runtime's chatter in them (gloo's connect
messages, absl INFO) is split out of the program's lines and marked (`_chatter.py`), each pipe
read by a `_pipes.Output`. An `Exited` event follows the process's last line, carrying its Python
traceback (or last stderr lines) for the launcher's failure table; it waits for what the process
itself wrote to be read, never for a descendant that still holds the pipes.

    procs = ProcessSet(worker=0, emit=outbound.put)
    procs.start(start_message)
    procs.stop(grace_s=3.0)        # SIGTERM now, SIGKILL after 3 s, to every process and descendant
    procs.end(grace_s=2.0)         # the same, waiting until nothing is left
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import tpudist._coordinator as _coordinator
import tpudist._proc as _proc
import tpudist.contract as contract
from tpudist.launch.agent import _dump
from tpudist.launch.agent._pipes import Output
from tpudist.launch.control import control_pb2 as pb

DRAIN_LIMIT_S = 1.0  # after an exit, at most this long to read what the process wrote (a flood)
_TAIL_LINES = 64
_PRIVATE_TOKEN = contract.PRIVATE_DIR_TOKEN.encode()
# the startup hook's directory (tpudist/_hook: a sitecustomize that installs the stack dumper)
_HOOK_DIR = os.fsencode(os.path.join(os.path.dirname(os.path.abspath(_proc.__file__)), "_hook"))
_CONDA_PLACES = ("~/miniconda3/bin/conda", "~/anaconda3/bin/conda", "~/miniforge3/bin/conda",
                 "~/mambaforge/bin/conda", "/opt/conda/bin/conda")
# Runs argv inside a conda environment: $0 is conda, $1 the environment, the rest the command. The
# user's argv are positional parameters, never part of the script text.
_CONDA_SCRIPT = ('_tpudist_activate=$("$0" shell.posix activate "$1") || '
                 '{ echo "tpudist: cannot activate conda environment $1 with $0" >&2; exit 127; }; '
                 'eval "$_tpudist_activate"; shift; exec "$@"')


def find_conda(env: dict[bytes, bytes]) -> str | None:
    """The conda executable: $CONDA_EXE, `conda` on PATH, or a usual install place."""
    exe = env.get(b"CONDA_EXE")
    if exe and os.access(exe, os.X_OK):
        return os.fsdecode(exe)
    import shutil  # here: its imports (bz2, lzma) would cost every agent's start-up

    found = shutil.which("conda", path=os.fsdecode(env.get(b"PATH", b"")))
    if found:
        return found
    for place in _CONDA_PLACES:
        path = os.path.expanduser(place)
        if os.access(path, os.X_OK):
            return path
    return None


def last_traceback(lines: list[bytes], limit: int = 30) -> list[bytes]:
    """The last Python traceback among `lines` (through its final line), else faulthandler's report
    of a fatal signal (SIGSEGV: the crashing thread's stack first), else the last few lines."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(b"Traceback (most recent call last)"):
            return lines[i:][-limit:]
        if lines[i].startswith(b"Fatal Python error: "):
            report = [line for line in lines[i:] if not line.startswith(b"Extension modules: ")]
            start = next((j for j, line in enumerate(report) if line.startswith(b"Current thread ")), 1)
            end = next((j for j in range(start, len(report)) if not report[j].strip()), len(report))
            return (report[:1] + report[start:end] + report[1:start] + report[end:])[:limit]
    return lines[-10:]


class _Process:
    def __init__(self, spec: pb.ProcessSpec, attempt: int, worker: int, emit: Callable,
                 on_exit: Callable[["_Process"], None]) -> None:
        self.spec, self.attempt, self.worker, self.emit = spec, attempt, worker, emit
        self.on_exit = on_exit
        self.popen: subprocess.Popen | None = None
        self.tail: collections.deque[bytes] = collections.deque(maxlen=_TAIL_LINES)
        self.exited = threading.Event()
        self.t0 = time.monotonic()
        self.debug_dir = ""  # its TPUDIST_DEBUG_DIR (stacks, progress), "" for none
        self.oom_kills: int | None = None  # the kernel's OOM kill count when it started

    def environ(self) -> dict[bytes, bytes]:
        env = dict(os.environb)
        for var in self.spec.env:
            env[var.name] = var.value
        if self.spec.path_prepend:
            env[b"PATH"] = b":".join([*self.spec.path_prepend, env.get(b"PATH", os.defpath.encode())])
        if self.debug_dir:
            env[b"TPUDIST_DEBUG_DIR"] = os.fsencode(self.debug_dir)  # contract.DEBUG_DIR
            if env.get(b"TPUDIST_STARTUP_HOOK") != b"0":  # contract.STARTUP_HOOK
                path = env.get(b"PYTHONPATH")
                env[b"PYTHONPATH"] = _HOOK_DIR + (b":" + path if path else b"")
        return env

    def start(self) -> None:
        env = self.environ()
        try:  # the coordinator's socket path: this user's private directory here (tpudist/_coordinator.py)
            for name, value in env.items():
                if _PRIVATE_TOKEN in value:
                    env[name] = os.fsencode(_coordinator.resolve_private(os.fsdecode(value)))
        except RuntimeError as e:
            return self._failed(1, f"{e}")
        argv = list(self.spec.argv)
        if self.spec.conda_env:
            conda = find_conda(env)
            if conda is None:
                return self._failed(127, "conda not found ($CONDA_EXE, PATH, ~/miniconda3, ~/anaconda3, "
                                         "/opt/conda); install it on this host or use --venv")
            argv = [b"/bin/sh", b"-c", _CONDA_SCRIPT.encode(), os.fsencode(conda),
                    self.spec.conda_env.encode(), *argv]
        if self.debug_dir:
            _dump.clear(self.debug_dir)
        self.oom_kills = _dump.oom_kills()
        try:
            self.popen = subprocess.Popen(
                argv, env=env, cwd=self.spec.cwd or None, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except FileNotFoundError as e:
            if self.spec.cwd and e.filename in (self.spec.cwd, os.fsdecode(self.spec.cwd)):
                return self._failed(127, f"working directory not found: {os.fsdecode(self.spec.cwd)}")
            return self._failed(127, f"command not found: {os.fsdecode(argv[0])}")
        except OSError as e:
            return self._failed(126, f"cannot start {os.fsdecode(argv[0])}: {e.strerror}")
        self.t0 = time.monotonic()
        self.emit(pb.AgentMessage(worker=self.worker, started=pb.Started(
            rank=self.spec.rank, pid=self.popen.pid, attempt=self.attempt)))
        exit_r, exit_w = os.pipe()
        outputs = []
        for pipe, stream, tail in ((self.popen.stdout, pb.STDOUT, None), (self.popen.stderr, pb.STDERR, self.tail)):
            outputs.append(Output(os.dup(pipe.fileno()), self.spec.rank, stream, self.emit, exit_r, tail))
            pipe.close()
        for output in outputs:
            threading.Thread(target=output.run, daemon=True).start()
        threading.Thread(target=self._wait, args=(outputs, exit_r, exit_w), daemon=True).start()

    def _failed(self, code: int, error: str) -> None:
        self.emit(pb.AgentMessage(worker=self.worker, exited=pb.Exited(
            rank=self.spec.rank, exit_code=code, attempt=self.attempt, error=error)))
        self.exited.set()

    def _wait(self, outputs: list[Output], exit_r: int, exit_w: int) -> None:
        code = self.popen.wait()
        run_s = time.monotonic() - self.t0
        os.write(exit_w, b"x")  # wakes the readers: read what is left, then say so
        # The process's last lines come before its exit event; a child holding the pipes does not
        # hold that event back (a flood of its lines gets DRAIN_LIMIT_S).
        end = time.monotonic() + DRAIN_LIMIT_S
        for output in outputs:
            output.drained.wait(max(0.0, end - time.monotonic()))
        tail = last_traceback(list(self.tail))
        if code == -signal.SIGKILL and (note := _dump.sigkill_note(self.oom_kills)):
            tail = [*tail, note]
        self.emit(pb.AgentMessage(worker=self.worker, exited=pb.Exited(
            rank=self.spec.rank, exit_code=max(code, 0), signal=max(-code, 0), run_s=run_s,
            tail=tail, attempt=self.attempt)))
        self.exited.set()
        self.on_exit(self)
        threading.Thread(target=_close_after, args=(outputs, exit_r, exit_w), daemon=True).start()

    def signal_group(self, signum: int) -> None:
        # Also after the leader exited: children left in its group must not outlive the job.
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def leftovers(self, table: dict, popen_pids: set[int]) -> list[int]:
        """Live processes this one left behind: its group's members, and the orphans (re-parented
        to the agent, a subreaper) whose environment carries its RANK and attempt, with their
        descendants."""
        if self.popen is None:
            return []
        found = [pid for pid, (_, pgid, state) in table.items() if pgid == self.popen.pid and state != "Z"]
        import tpudist.contract as contract  # here: its dataclasses import would cost every agent's start-up

        me = os.getpid()
        want = {contract.RANK.encode(): str(self.spec.rank).encode(),
                contract.RESTART.encode(): str(self.attempt).encode()}
        for pid, (ppid, _, state) in table.items():
            if ppid == me and pid not in popen_pids and state != "Z" and _carries(pid, want):
                found += [pid, *_proc.descendants(pid, table)]
        return sorted(set(found))


def _carries(pid: int, want: dict[bytes, bytes]) -> bool:
    """Whether process `pid` started with these environment values (inherited from a rank)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0"))
    except OSError:
        return False
    return all(env.get(k) == v for k, v in want.items())


def _close_after(outputs: list[Output], exit_r: int, exit_w: int) -> None:
    """Closes the exit pipe once no reader looks at it again (a drained one never does)."""
    os.close(exit_w)
    for output in outputs:
        output.drained.wait()
    os.close(exit_r)


class ProcessSet:
    """The processes of one host for the current attempt, and everything they started."""

    def __init__(self, worker: int, emit: Callable[[object], None]) -> None:
        self.worker, self.emit = worker, emit
        self.procs: list[_Process] = []
        self.grace_s = 0.0  # the launcher's --stop-grace, from each Start
        self.debug_root = ""  # the agent's directory for each process's TPUDIST_DEBUG_DIR ("" none)
        self._lock = threading.Lock()  # also keeps reaping away from a Popen being created
        self._popen_pids: set[int] = set()  # running Popen children: Popen reaps them, never `reap`
        self._kill_timer: threading.Timer | None = None
        # A stop's delayed SIGKILL reaches every descendant of the agent, so it must never run once
        # the next attempt started: `start` cancels it and holds `_killing` while it spawns.
        self._killing = threading.Lock()

    def start(self, start: pb.Start) -> None:
        with self._lock:
            previous = list(self.procs)
        self._cancel_kill_timer()
        self._kill(previous)  # a restart: whatever is left of the previous attempt goes first
        with self._killing, self._lock:
            self.grace_s = start.grace_s
            self.procs = [_Process(spec, start.attempt, self.worker, self.emit, self._after_exit)
                          for spec in start.processes]
            for proc in self.procs:
                if self.debug_root:
                    proc.debug_dir = _dump.proc_dir(self.debug_root, proc.spec.rank)
                proc.start()
                if proc.popen is not None:
                    self._popen_pids.add(proc.popen.pid)

    def signal(self, signum: int) -> None:
        with self._lock:
            for proc in self.procs:
                if not proc.exited.is_set():
                    proc.signal_group(signum)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to every process group and descendant now, SIGKILL after `grace_s`; returns at once."""
        with self._lock:
            procs = list(self.procs)
        self._signal(procs, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        self._cancel_kill_timer()
        timer = threading.Timer(grace_s, self._kill_if_current, args=(procs,))
        timer.daemon = True
        with self._lock:
            self._kill_timer = timer
        timer.start()

    def _cancel_kill_timer(self) -> None:
        with self._lock:
            timer, self._kill_timer = self._kill_timer, None
        if timer is not None:
            timer.cancel()

    def _kill_if_current(self, procs: list[_Process]) -> None:
        """The delayed SIGKILL of `stop`, unless a later attempt has started since."""
        with self._killing:
            with self._lock:
                current = procs == self.procs
            if current:
                self._kill(procs)

    def end(self, grace_s: float) -> None:
        """Stops everything (as `stop`) and returns once no process or descendant is left, or it gave up."""
        with self._lock:
            procs = list(self.procs)
        if self.running() or _proc.descendants(os.getpid()):
            self._signal(procs, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            deadline = time.monotonic() + grace_s
            while (self.running() or _proc.descendants(os.getpid())) and time.monotonic() < deadline:
                time.sleep(0.02)
                self.reap()
        self._kill(procs)
        self.wait(2.0)  # their exit reports, with their last lines

    def _signal(self, procs: list[_Process], signum: int) -> None:
        """`signum` to every process group, then to every other descendant of this agent."""
        groups = set()
        for proc in procs:
            proc.signal_group(signum)
            if proc.popen is not None:
                groups.add(proc.popen.pid)
        table = _proc.process_table()
        _proc.send([pid for pid in _proc.descendants(os.getpid(), table) if table[pid][1] not in groups],
                   signum)

    def _kill(self, procs: list[_Process]) -> None:
        """SIGKILL to every group and descendant until none is left (bounded), and reaps the orphans."""
        end = time.monotonic() + 2.0
        while _proc.descendants(os.getpid()) and time.monotonic() < end:
            self._signal(procs, signal.SIGKILL)
            time.sleep(0.01)
            self.reap()
        for proc in procs:
            proc.signal_group(signal.SIGKILL)  # without a subreaper (not Linux) a group may hold others

    def _after_exit(self, proc: _Process) -> None:
        """One process ended: what it left behind gets SIGTERM, then SIGKILL after the grace period."""
        with self._lock:
            if proc.popen is not None:
                self._popen_pids.discard(proc.popen.pid)  # Popen has reaped it
            popen_pids = set(self._popen_pids)
            grace = self.grace_s
        if not proc.leftovers(_proc.process_table(), popen_pids):
            return

        def stop(signum: int) -> None:
            _proc.send(proc.leftovers(_proc.process_table(), popen_pids), signum)
            self.reap()

        stop(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        timer = threading.Timer(grace, stop, args=(signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    def reap(self) -> None:
        """Collects orphans that ended (they were re-parented to the agent); never a Popen's own child."""
        with self._lock:
            _proc.reap_orphans(keep=self._popen_pids)

    def wait(self, deadline_s: float) -> bool:
        """Waits for every process to exit; False when some are still running at the deadline."""
        end = time.monotonic() + deadline_s
        with self._lock:
            procs = list(self.procs)
        return all(p.exited.wait(max(0.0, end - time.monotonic())) for p in procs)

    def running(self) -> bool:
        with self._lock:
            return any(not p.exited.is_set() for p in self.procs)

    def debug_targets(self) -> list[tuple[int, int, str]]:
        """(rank, pid, TPUDIST_DEBUG_DIR) of every running process that has one."""
        with self._lock:
            return [(p.spec.rank, p.popen.pid, p.debug_dir) for p in self.procs
                    if p.debug_dir and p.popen is not None and not p.exited.is_set()]
