"""The processes' lines on the launcher's console and in --log-dir.

Every line is written whole, with its prefix, in one write to the launcher's stdout or stderr (the
stream the process used), so lines of different processes never interleave mid-line. `--log-dir`
gets one file per rank with both streams; `--ranks-filter` limits only the console. The
runtime's chatter (lines the agent marked: gloo's connect messages, absl INFO) goes to the log
files, and to the console only with `-v` (`verbose`).

    sink = LogSink("[w{worker} r{rank} {host}] ", plan, ranks={0}, log_dir=None)
    sink.write_batch(logs_message)
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Set
from typing import BinaryIO

from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.plan import ProcessPlan


class LogSink:
    def __init__(self, template: str, plan: list[ProcessPlan], *, ranks: Set[int] | None = None,
                 log_dir: str | None = None, stdout: BinaryIO | None = None,
                 stderr: BinaryIO | None = None, verbose: bool = False) -> None:
        self.ranks = ranks
        self.verbose = verbose
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.lock = threading.Lock()  # shared with anything else the launcher prints
        self.template = template
        self.replan(plan)
        self.files: dict[int, BinaryIO] = {}
        self.closed: set = set()  # console streams whose reader went away
        self.log_dir = log_dir
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.before_first_line = lambda: None  # e.g. take the live status off the screen

    def replan(self, plan: list[ProcessPlan]) -> None:
        """Each rank's prefix from `plan` (a restart over fewer hosts moves ranks to other hosts)."""
        self.prefixes = {p.rank: self.template.format(worker=p.worker, rank=p.rank, local_rank=p.local_rank,
                                                      host=p.host.address).encode() for p in plan}

    def write_batch(self, lines: Iterable[pb.LogLine]) -> None:
        out, err = [], []
        for line in lines:
            if self.log_dir:
                self._file(line.rank).write(line.data + b"\n")
            if (self.ranks is None or line.rank in self.ranks) and (self.verbose or not line.chatter):
                (err if line.stream == pb.STDERR else out).append(
                    self.prefixes.get(line.rank, b"") + line.data + b"\n")
        self.flush()
        if out or err:
            self.before_first_line()
            with self.lock:
                for stream, chunks in ((self.stdout, out), (self.stderr, err)):
                    if chunks and stream not in self.closed:
                        try:
                            stream.write(b"".join(chunks))
                            stream.flush()
                        except BrokenPipeError:  # e.g. `| head` has exited: the job goes on
                            self.closed.add(stream)

    def _file(self, rank: int) -> BinaryIO:
        f = self.files.get(rank)
        if f is None:
            f = self.files[rank] = open(os.path.join(self.log_dir, f"rank{rank}.log"), "ab")
        return f

    def flush(self) -> None:
        for f in self.files.values():
            f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
