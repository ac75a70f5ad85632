"""The runtime's chatter in a process's output: recognised, split out of the program's lines, marked.

Native runtimes under a program print connection and start-up messages on the same stdout/stderr
as the program, from their own threads. They reach the launcher's log files and `-v`, not the
console by default. The table (`PATTERNS`):

| name | what | example |
|---|---|---|
| `gloo` | gloo's connect message, one per communicator, from the thread that connected it | `[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1` |
| `absl-preinit` | absl's notice before its logging is initialised (gRPC, XLA) | `WARNING: All log messages before absl::InitializeLog() is called are written to STDERR` |
| `absl-info` | absl/glog INFO lines (`I` + date); WARNING and ERROR lines stay on the console | `I0000 00:00:1700000000.123456  4242 service.cc:152] XLA service ...` |
| `tpudist-goodput` | `fit`'s goodput so far, for the launcher's summary (contract.GOODPUT_REPORT) | `tpudist-goodput {"attempt": 0, "wall_s": 12.5, ...}` |

gloo writes its message in pieces (`"[Gloo] Rank "`, the rank, `" is connected to "`, the count,
`" peer ranks. "`, `"Expected number of connected peer ranks is : "`, the count, a newline) through
C stdio, one piece at a time, while other communicators' threads write theirs and Python writes to
the same file descriptor directly. So pieces of several messages and of a program line can share
a line in any order (`[Gloo] Rank 1[Gloo] Rank  is connected to 03 is connected to  peer ...`). In
a line holding a piece of gloo's message, every constant piece is chatter, and so is a number next
to one; what remains is the program's text, in order. The newline ending such a line was gloo's if
a message's last piece has come and its newline not yet, and the line ended with chatter: then the
program's text had not ended, and is held to continue with the stream's next line, so the
program's line arrives whole; an empty line while a message's newline is owed is that newline. A
number can also come lines later, at the start of a line (`1step 20/60`): while numbers of seen
messages are missing, a line's leading digits (followed by a letter or nothing) are taken as one.

    chatter = Chatter()
    chatter.feed(b"step 5[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    # -> [(True, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected ... : 1")]; b"step 5" is held
    chatter.feed(b"")   # -> [(False, b"step 5")]
"""

from __future__ import annotations

import re

from tpudist import contract

# gloo's message: its constant pieces (each message has each once, and three numbers).
_HEAD, _END = b"[Gloo] Rank ", b"Expected number of connected peer ranks is : "
_GLOO_CONSTANTS = re.compile(rb"(\[Gloo\] Rank | is connected to | peer ranks\. |"
                             rb"Expected number of connected peer ranks is : )")
# Only lines holding one of these are searched for pieces (" is connected to " alone is English).
_GLOO_MARKERS = (_HEAD, b" peer ranks. ", _END)
_BEFORE_NUMBER = (_HEAD, b" is connected to ", _END)  # a number follows each of these pieces
_LEADING_NUMBER = re.compile(rb"^\d+(?=[A-Za-z_\[]|$)")
_DIGITS = re.compile(rb"\d+")

PATTERNS = {  # whole-line chatter: name -> pattern
    "absl-preinit": re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called "
                               rb"are written to STDERR$"),
    # glog's `I1201 21:40:00.123456  4242 file.cc:12] `; before absl knows the date, `00:00:<epoch s>`
    "absl-info": re.compile(rb"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.+-]+:\d+\] "),
    # fit's report to the launcher (tpudist/launch/_goodput.py)
    "tpudist-goodput": re.compile(b"^" + re.escape(contract.GOODPUT_REPORT.encode())),
}
MAX_HELD = 1 << 20  # a held line longer than this is passed on as it is
OWED_LINES = 64  # a missing gloo number is looked for at the start of this many following lines


class Chatter:
    """Splits one output stream's lines into the program's and the runtime's (see the module)."""

    def __init__(self) -> None:
        self.held = b""  # the program's text of a line that chatter cut: continues with the next line
        self.owed_numbers = 0  # numbers of seen gloo messages not seen yet
        self.owed_newlines = 0  # newlines of gloo messages whose last piece came
        self.owed_lines = 0  # ... both looked for in this many more lines

    def feed(self, line: bytes) -> list[tuple[bool, bytes]]:
        """One line of the stream (without its newline) -> [(is_chatter, text), ...] in order."""
        self.owed_lines -= 1
        if self.owed_lines <= 0:
            self.owed_numbers = self.owed_newlines = 0
        out: list[tuple[bool, bytes]] = []
        if not self.held and self.owed_numbers and (number := _LEADING_NUMBER.match(line)):
            self.owed_numbers -= 1
            out.append((True, number.group()))
            line = line[number.end():]
            if not line:  # the number and a message's newline
                self.owed_newlines = max(0, self.owed_newlines - 1)
                return out
        if not line and not self.held and self.owed_newlines:
            self.owed_newlines -= 1  # a message's newline, after its text came on an earlier line
            return out
        line, self.held = self.held + line, b""
        if any(marker in line for marker in _GLOO_MARKERS):
            return out + self._gloo(line)
        if any(p.search(line) for p in PATTERNS.values()):
            return [*out, (True, line)]
        return [*out, (False, line)]

    def _gloo(self, line: bytes) -> list[tuple[bool, bytes]]:
        parts = _GLOO_CONSTANTS.split(line)  # text, constant, text, ..., text
        chatter, program = bytearray(), bytearray()
        self.owed_numbers += 3 * parts[1::2].count(_HEAD)
        self.owed_newlines += parts[1::2].count(_END)
        self.owed_lines = OWED_LINES
        ends_with_chatter = False
        for i in range(0, len(parts), 2):
            text, before = parts[i], parts[i - 1] if i else None
            if before is not None:
                chatter += before
            # the number a piece is followed by, or a number standing between pieces
            number = _DIGITS.match(text) if before in _BEFORE_NUMBER or text.isdigit() else None
            if number:
                chatter += number.group()
                text = text[number.end():]
                self.owed_numbers = max(0, self.owed_numbers - 1)
            program += text
            ends_with_chatter = not text
        out = [(True, bytes(chatter))]
        if not program:
            self.owed_newlines = max(0, self.owed_newlines - 1)
        elif ends_with_chatter and self.owed_newlines and len(program) < MAX_HELD:
            self.held = bytes(program)  # this line's newline was a message's: the program's line goes on
            self.owed_newlines -= 1
        else:
            out.append((False, bytes(program)))  # the program's newline
        return out

    def flush(self) -> list[tuple[bool, bytes]]:
        """The held text, at the end of the stream (the program never ended its line)."""
        held, self.held = self.held, b""
        return [(False, held)] if held else []
