"""Every rank's Python stacks on request, and what it last did: the runtime's side of hang reports.

Under the launcher, whose agent gives each process a private directory in TPUDIST_DEBUG_DIR, the
first Python process of each rank calls `install()` at start-up (the agent's startup hook,
tpudist/_hook/sitecustomize.py: any Python program, tpudist or not), and `tpudist.init()` calls it
too (a no-op once installed). The first process to claim the directory (DIR/claim) installs; the
others a rank starts (a wrapper's child, a spawned worker) skip while it runs, and the next one to
start after it ended takes the claim over. It

- registers faulthandler on `STACKS_SIGNAL`, all threads, writing to DIR/stacks. The dump is
  written by the signal handler itself (C, no GIL), so it comes while the main thread sleeps in C,
  spins in Python holding the GIL, waits on a lock, or waits inside a collective;
- maps DIR/progress, where `entered(name)` records each eager collective (a count, the name,
  when: one write to shared memory, no system call), so the agent sees progress and the launcher
  the last collective a rank entered;
- writes DIR/ready (its pid and main thread id) once the dumper is in place: the agent signals
  only such a process, since the signal would end one without the handler.

Always, unless the program enabled faulthandler itself: faulthandler on the fatal signals
(SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) to stderr, all threads, so a crashed rank's Python
stack reaches the launcher's failure table.

    dump = parse_dump(text)                  # the agent's DIR/stacks, after STACKS_SIGNAL
    main = next(t for t in dump if t.ident == main_ident)
    main.frames[0]                           # Frame(file='train.py', line=12, function='load')

Standard library only (and the contract): the agent and the launcher read the layout from here.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import re
import signal
import struct
import sys
import threading
import time
from typing import NamedTuple

import tpudist.contract as contract

STACKS_SIGNAL = signal.SIGRTMIN + 4  # a real-time signal: nothing else in the job uses it
STACKS_FILE, PROGRESS_FILE, READY_FILE, CLAIM_FILE = "stacks", "progress", "ready", "claim"
# The progress record: magic, collectives entered, when the last one was entered (CLOCK_MONOTONIC,
# comparable between the processes of one host), its name.
_LAYOUT = struct.Struct("<4sQd64s")
_MAGIC = b"TPDP"

_progress: mmap.mmap | None = None
_stacks_file = None  # kept open: faulthandler writes to its descriptor
_collectives = 0


# NamedTuples, not dataclasses: every host's agent imports this module before it registers, and
# `dataclasses` costs ~3 ms of that start (tests/launch/test_deferred.py).
class Frame(NamedTuple):
    file: str
    line: int
    function: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}"


class Thread(NamedTuple):
    ident: int
    current: bool  # the thread the signal landed on (not necessarily the main one)
    frames: tuple[Frame, ...]  # innermost first, as faulthandler prints them


class Progress(NamedTuple):
    collectives: int  # eager collectives entered so far
    name: str  # the last one
    entered_at: float  # time.monotonic() when it was entered


def install(environ=os.environ) -> None:
    """The stack dumper and progress record (under the launcher), and faulthandler on fatal
    signals; at most once per process, in one process per rank. Called by the launcher's startup
    hook and by `tpudist.init()`."""
    global _progress, _stacks_file
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)  # stderr: the agent keeps it for the failure table
    directory = environ.get(contract.DEBUG_DIR)
    if not directory or _stacks_file is not None:
        return
    try:  # one process per rank: the first to claim the directory, or the next once it has ended
        if not _claim(os.path.join(directory, CLAIM_FILE)):
            return
    except OSError as e:
        print(f"tpudist: no stack dumper for hang reports ({directory}: {e.strerror})", file=sys.stderr)
        return
    try:
        stacks = open(os.path.join(directory, STACKS_FILE), "ab", buffering=0)
        fd = os.open(os.path.join(directory, PROGRESS_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            progress = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
        ready = os.path.join(directory, READY_FILE)
        with open(ready + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {threading.main_thread().ident}\n")
        os.replace(ready + ".tmp", ready)
    except OSError as e:  # the hang report then says this rank has no dumper; the job runs on
        print(f"tpudist: no stack dumper for hang reports ({directory}: {e.strerror})", file=sys.stderr)
        return
    _stacks_file, _progress = stacks, progress
    _LAYOUT.pack_into(_progress, 0, _MAGIC, 0, 0.0, b"")


def _claim(path: str) -> bool:
    """Whether this process now holds the claim at `path`: created here, or taken over from a
    process that has ended (`sh -c "python prepare.py && python train.py"`: train.py's turn)."""
    me = f"{os.getpid()}\n".encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            with open(path, "rb") as f:
                holder = int(f.read().split()[0])
            os.kill(holder, 0)
            return False  # held by a process that runs
        except ProcessLookupError:
            pass  # it ended: take it over
        except (OSError, ValueError, IndexError):
            return False
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(me)
        os.replace(tmp, path)
        with open(path, "rb") as f:
            return f.read() == me  # of two that took it over at once, the last one's
    os.write(fd, me)
    os.close(fd)
    return True


def entered(name: str) -> None:
    """Records that this process entered the collective `name` (cheap: a shared-memory write)."""
    global _collectives
    if _progress is not None:
        _collectives += 1
        _LAYOUT.pack_into(_progress, 0, _MAGIC, _collectives, time.monotonic(), name.encode()[:64])


def read_progress(directory: str) -> Progress | None:
    """A process's progress record, None before its `install`."""
    try:
        with open(os.path.join(directory, PROGRESS_FILE), "rb") as f:
            data = f.read(_LAYOUT.size)
    except OSError:
        return None
    if len(data) < _LAYOUT.size:
        return None
    magic, count, at, name = _LAYOUT.unpack(data)
    if magic != _MAGIC:
        return None
    return Progress(count, name.rstrip(b"\0").decode(errors="replace"), at)


def read_ready(directory: str) -> tuple[int, int] | None:
    """(pid, main thread id) of the process whose dumper is in place, None before."""
    try:
        with open(os.path.join(directory, READY_FILE)) as f:
            pid, ident = f.read().split()
        return int(pid), int(ident)
    except (OSError, ValueError):
        return None


_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_dump(text: str) -> list[Thread]:
    """faulthandler's all-threads text -> threads, each with its frames innermost first."""
    threads: list[Thread] = []
    ident, current, frames = None, False, []
    for line in text.splitlines():
        if m := _THREAD_RE.match(line):
            if ident is not None:
                threads.append(Thread(ident, current, tuple(frames)))
            ident, current, frames = int(m.group(2), 16), m.group(1) == "Current thread", []
        elif ident is not None and (m := _FRAME_RE.match(line)):
            frames.append(Frame(m.group(1), int(m.group(2)), m.group(3).strip()))
    if ident is not None:
        threads.append(Thread(ident, current, tuple(frames)))
    return threads
