"""The agent's side of a job: one host's processes, their output and their exits.

Each process runs in its own session (so its own process group): stopping it signals the whole group,
which also reaches the children it started. Every stdout/stderr line becomes a `LogLine` event, and
an `Exited` event follows the process's last line, carrying its Python traceback (or last stderr
lines) for the launcher's failure table.

    procs = ProcessSet(worker=0, emit=outbound.put)
    procs.start(start_message)
    procs.stop(grace_s=3.0)        # SIGTERM now, SIGKILL after 3 s
    procs.wait(deadline_s=5.0)
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from tpudist.launch.control import control_pb2 as pb

MAX_LINE = 1 << 20  # a line longer than this is passed on in pieces, to bound the agent's memory
_TAIL_LINES = 64
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
    """The last Python traceback among `lines` (through its final line), else the last few lines."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(b"Traceback (most recent call last)"):
            return lines[i:][-limit:]
    return lines[-10:]


class _Process:
    def __init__(self, spec: pb.ProcessSpec, attempt: int, worker: int, emit: Callable) -> None:
        self.spec, self.attempt, self.worker, self.emit = spec, attempt, worker, emit
        self.popen: subprocess.Popen | None = None
        self.tail: collections.deque[bytes] = collections.deque(maxlen=_TAIL_LINES)
        self.exited = threading.Event()
        self.t0 = time.monotonic()

    def environ(self) -> dict[bytes, bytes]:
        env = dict(os.environb)
        for var in self.spec.env:
            env[var.name] = var.value
        if self.spec.path_prepend:
            env[b"PATH"] = b":".join([*self.spec.path_prepend, env.get(b"PATH", os.defpath.encode())])
        return env

    def start(self) -> None:
        env = self.environ()
        argv = list(self.spec.argv)
        if self.spec.conda_env:
            conda = find_conda(env)
            if conda is None:
                return self._failed(127, "conda not found ($CONDA_EXE, PATH, ~/miniconda3, ~/anaconda3, "
                                         "/opt/conda); install it on this host or use --venv")
            argv = [b"/bin/sh", b"-c", _CONDA_SCRIPT.encode(), os.fsencode(conda),
                    self.spec.conda_env.encode(), *argv]
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
        readers = [threading.Thread(target=self._read, args=(self.popen.stdout, pb.STDOUT), daemon=True),
                   threading.Thread(target=self._read, args=(self.popen.stderr, pb.STDERR), daemon=True)]
        for r in readers:
            r.start()
        threading.Thread(target=self._wait, args=(readers,), daemon=True).start()

    def _failed(self, code: int, error: str) -> None:
        self.emit(pb.AgentMessage(worker=self.worker, exited=pb.Exited(
            rank=self.spec.rank, exit_code=code, attempt=self.attempt, error=error)))
        self.exited.set()

    def _read(self, pipe, stream: int) -> None:
        with pipe:
            while line := pipe.readline(MAX_LINE):
                line = line[:-1] if line.endswith(b"\n") else line
                if stream == pb.STDERR:
                    self.tail.append(line)
                self.emit(pb.LogLine(rank=self.spec.rank, stream=stream, data=line))

    def _wait(self, readers: list[threading.Thread]) -> None:
        code = self.popen.wait()
        run_s = time.monotonic() - self.t0
        # The last lines come before the exit event; a child that kept the pipes open gets a short grace.
        for r in readers:
            r.join(timeout=1.0)
        self.emit(pb.AgentMessage(worker=self.worker, exited=pb.Exited(
            rank=self.spec.rank, exit_code=max(code, 0), signal=max(-code, 0), run_s=run_s,
            tail=last_traceback(list(self.tail)), attempt=self.attempt)))
        self.exited.set()

    def signal_group(self, signum: int) -> None:
        # Also after the leader exited: children left in its group must not outlive the job.
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


class ProcessSet:
    """The processes of one host for the current attempt."""

    def __init__(self, worker: int, emit: Callable[[object], None]) -> None:
        self.worker, self.emit = worker, emit
        self.procs: list[_Process] = []
        self._lock = threading.Lock()
        self._kill_timer: threading.Timer | None = None

    def start(self, start: pb.Start) -> None:
        with self._lock:
            self._kill(self.procs)  # a restart: whatever is left of the previous attempt goes first
            self.procs = [_Process(spec, start.attempt, self.worker, self.emit) for spec in start.processes]
            for proc in self.procs:
                proc.start()

    def signal(self, signum: int) -> None:
        with self._lock:
            for proc in self.procs:
                if not proc.exited.is_set():
                    proc.signal_group(signum)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to every process group now, SIGKILL after `grace_s`; returns at once."""
        with self._lock:
            procs = list(self.procs)
        for proc in procs:
            proc.signal_group(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._kill_timer = threading.Timer(grace_s, self._kill, args=(procs,))
        self._kill_timer.daemon = True
        self._kill_timer.start()

    def kill_groups(self) -> None:
        """SIGKILL to every process group of this attempt, including those whose leader exited."""
        with self._lock:
            self._kill(list(self.procs))

    @staticmethod
    def _kill(procs: list[_Process]) -> None:
        for proc in procs:
            proc.signal_group(signal.SIGKILL)

    def wait(self, deadline_s: float) -> bool:
        """Waits for every process to exit; False when some are still running at the deadline."""
        end = time.monotonic() + deadline_s
        with self._lock:
            procs = list(self.procs)
        return all(p.exited.wait(max(0.0, end - time.monotonic())) for p in procs)

    def running(self) -> bool:
        with self._lock:
            return any(not p.exited.is_set() for p in self.procs)
