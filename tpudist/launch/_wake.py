"""A queue that signal handlers and threads put into, and one thread waits on with a deadline that holds.

A Python signal handler runs on the main thread between two bytecodes, possibly while that thread
is inside a queue's `get`. Two standard queues fail that way here:
- `threading.Event.set` (and `queue.Queue.put`) in a handler waits for a lock the interrupted
  thread holds: a deadlock (seen in CI: a SIGKILLed launcher's processes outlived it);
- CPython 3.11's `queue.SimpleQueue.get(timeout=...)`, when its deadline passes inside the call,
  goes on waiting with no deadline, and a signal that arrived meanwhile does not interrupt it
  (seen in CI once; here 5 of 12 runs on a loaded machine hung, and every run with waits of 1 us).

`WakeQueue.put` appends to a deque (atomic, no Python-level lock) and writes a byte to a
non-blocking pipe; `get` polls the pipe with the time left, so a put that lands before the poll
begins still wakes it, and the deadline is the caller's own.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class WakeQueue(Generic[T]):
    """Unbounded FIFO: `put` from any thread or signal handler, `get` from one thread."""

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._read, self._write = os.pipe()  # not inherited by processes started meanwhile
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._poll = select.poll()
        self._poll.register(self._read, select.POLLIN)

    def __del__(self) -> None:  # nothing can put into a queue that nobody references
        for fd in (getattr(self, "_read", -1), getattr(self, "_write", -1)):
            if fd >= 0:
                os.close(fd)

    def put(self, item: T) -> None:
        self._items.append(item)
        try:
            os.write(self._write, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def get_nowait(self) -> T:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float) -> T:
        """The next item, waiting up to `timeout` seconds for one; `queue.Empty` if none came."""
        deadline = time.monotonic() + timeout
        while True:
            if self._items:
                return self._items.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            self._poll.poll(left * 1000)  # after a signal's handler, Python polls again with the time left
            try:
                os.read(self._read, 4096)  # the wake-ups so far; an item put after this writes anew
            except BlockingIOError:
                pass
