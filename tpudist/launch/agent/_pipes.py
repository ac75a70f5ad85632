"""One of a process's output pipes, read on a thread of its own into `LogLine` events, so that
the agent's memory stays bounded (lines over 1 MiB go on in pieces) and an exit waits only for what
the process itself wrote."""

from __future__ import annotations

import collections
import os
import select
import threading
from collections.abc import Callable

from tpudist.launch.agent._chatter import Chatter
from tpudist.launch.control import control_pb2 as pb

MAX_LINE = 1 << 20  # a line longer than this is passed on in pieces, to bound the agent's memory
_READ_BYTES = 1 << 16


class Output:
    """One of a process's pipes: whole lines out as `LogLine`s, and `drained` once the process has
    exited and everything it wrote has been read.

    The pipe's write end may outlive the process (a child holds it): then EOF comes only when that
    child ends, so after the exit the reader looks once more for data already in the pipe and
    reports `drained` as soon as there is none, while it goes on passing on the child's lines."""

    def __init__(self, fd: int, rank: int, stream: int, emit: Callable, exit_fd: int,
                 tail: collections.deque | None) -> None:
        self.fd, self.rank, self.stream, self.emit = fd, rank, stream, emit
        self.exit_fd = exit_fd  # readable once the process has exited
        self.tail = tail  # stderr keeps its last lines for the exit report
        self.drained = threading.Event()
        self._pending = bytearray()
        self._chatter = Chatter()

    def run(self) -> None:
        exited = False
        try:
            while True:
                if not exited:
                    ready = select.select([self.fd, self.exit_fd], [], [])[0]
                    exited = self.exit_fd in ready
                    if exited and self.fd not in ready and not select.select([self.fd], [], [], 0)[0]:
                        self._drain()
                        continue
                elif not self.drained.is_set() and not select.select([self.fd], [], [], 0)[0]:
                    self._drain()
                    continue
                data = os.read(self.fd, _READ_BYTES)
                if not data:
                    break
                self._lines(data)
        except OSError:
            pass
        finally:
            self._flush()
            self._end_held()
            self.drained.set()
            os.close(self.fd)

    def _drain(self) -> None:
        self._flush()  # the process's last line, even without its newline
        self._end_held()
        self.drained.set()

    def _end_held(self) -> None:
        for chatter, text in self._chatter.flush():
            self._emit(text, chatter)

    def _lines(self, data: bytes) -> None:
        pieces = data.split(b"\n")
        self._pending += pieces[0]
        for piece in pieces[1:]:  # each one follows a newline: the pending line is whole
            self._flush(whole=True)
            self._pending += piece
        while len(self._pending) > MAX_LINE:  # a line without end yet: pass it on in pieces
            self._line(bytes(self._pending[:MAX_LINE]))
            del self._pending[:MAX_LINE]

    def _flush(self, whole: bool = False) -> None:
        """Passes the pending line on (in MAX_LINE pieces); an empty one only if it was a line."""
        while len(self._pending) > MAX_LINE:
            self._line(bytes(self._pending[:MAX_LINE]))
            del self._pending[:MAX_LINE]
        if self._pending or whole:
            self._line(bytes(self._pending))
        self._pending = bytearray()

    def _line(self, line: bytes) -> None:
        for chatter, text in self._chatter.feed(line):
            self._emit(text, chatter)

    def _emit(self, text: bytes, chatter: bool) -> None:
        if self.tail is not None and not chatter:
            self.tail.append(text)
        self.emit(pb.LogLine(rank=self.rank, stream=self.stream, data=text, chatter=chatter))
