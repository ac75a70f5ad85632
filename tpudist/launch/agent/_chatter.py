"""The runtime's chatter in a process's output: recognised, split out of the program's lines, marked.

Native runtimes under a program print connection and start-up messages on the same stdout/stderr
as the program, from their own threads. They reach the launcher's log files and `-v`, not the
console by default. The table (`PATTERNS`):

| name | what | example |
|---|---|---|
| `gloo` | gloo's connect message, one per communicator, from the thread that connected it | `[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1` |
| `absl-preinit` | absl's notice before its logging is initialised (gRPC, XLA) | `WARNING: All log messages before absl::InitializeLog() is called are written to STDERR` |
| `absl-info` | absl/glog INFO lines (`I` + date); WARNING and ERROR lines stay on the console | `I0000 00:00:1700000000.123456  4242 service.cc:152] XLA service ...` |

gloo writes its message in pieces (`"[Gloo] Rank "`, the rank, `" is connected to "`, ...) through
C stdio, flushed at its end, while Python writes to the same file descriptor directly: pieces of
two communicators' messages, or of a message and a program line, can share a line
(`Rank 3 is connected to 3[Gloo] Rank 2 ...`). So a line that holds any piece of the gloo message
has every piece removed as chatter; what remains is the program's. If the line ended with the
message's last piece, its newline was gloo's and the program's text before it had not ended yet:
it is held and continues with the stream's next line, so the program's line arrives whole. A
number piece can come later still, at the start of a later line (`1step 20/60` after a lone
`[Gloo] Rank `): while a piece that a number follows has been seen without its number, a line's
leading digits are taken as that number.

    chatter = Chatter()
    chatter.feed(b"step 5[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    # -> [(True, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected ...: 1")]; b"step 5" is held
    chatter.feed(b"")   # -> [(False, b"step 5")]
"""

from __future__ import annotations

import re

# gloo's message, as its pieces are written; a piece may stand alone where another write cut in.
_GLOO_END = rb"Expected number of connected peer ranks is : (?:\d+)?"
_GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank (?:\d+(?: is connected to (?:\d+(?: peer ranks\. (?:" + _GLOO_END + rb")?)?)?)?)?"
    rb"| is connected to (?:\d+(?: peer ranks\. (?:" + _GLOO_END + rb")?)?)?"
    rb"| peer ranks\. (?:" + _GLOO_END + rb")?"
    rb"|" + _GLOO_END)
# Only lines holding one of these are searched for pieces (" is connected to " alone is English).
_GLOO_MARKERS = (b"[Gloo] Rank ", b" peer ranks. ", b"Expected number of connected peer ranks is : ")
_GLOO_ENDS_LINE = re.compile(rb"Expected number of connected peer ranks is : \d+$")
_GLOO_BEFORE_NUMBER = (b"[Gloo] Rank ", b" is connected to ", b"peer ranks is : ")  # a number follows each
_LEADING_NUMBER = re.compile(rb"^\d+")

PATTERNS = {  # whole-line chatter: name -> pattern
    "absl-preinit": re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called "
                               rb"are written to STDERR$"),
    # glog's `I1201 21:40:00.123456  4242 file.cc:12] `; before absl knows the date, `00:00:<epoch s>`
    "absl-info": re.compile(rb"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.+-]+:\d+\] "),
}
MAX_HELD = 1 << 20  # a held line longer than this is passed on as it is
OWED_LINES = 64  # a missing gloo number is looked for at the start of this many following lines


class Chatter:
    """Splits one output stream's lines into the program's and the runtime's (see the module)."""

    def __init__(self) -> None:
        self.held = b""  # the program's text of a line that chatter cut: continues with the next line
        self.owed = 0  # gloo numbers not seen yet after the pieces they follow
        self.owed_lines = 0  # ... looked for in this many more lines

    def feed(self, line: bytes) -> list[tuple[bool, bytes]]:
        """One line of the stream (without its newline) -> [(is_chatter, text), ...] in order."""
        out: list[tuple[bool, bytes]] = []
        self.owed_lines -= 1
        if self.owed_lines <= 0:
            self.owed = 0
        if self.owed and not self.held and (number := _LEADING_NUMBER.match(line)):
            self.owed -= 1
            out.append((True, number.group()))
            line = line[number.end():]
            if not line:
                return out
        line, self.held = self.held + line, b""
        if any(marker in line for marker in _GLOO_MARKERS):
            pieces = [m.group() for m in _GLOO_PIECES.finditer(line)]
            rest = _GLOO_PIECES.sub(b"", line)
            owed = sum(p.endswith(_GLOO_BEFORE_NUMBER) for p in pieces)
            if owed:
                self.owed, self.owed_lines = self.owed + owed, OWED_LINES
            out += [(True, p) for p in pieces]
            if rest and _GLOO_ENDS_LINE.search(line) and len(rest) < MAX_HELD:
                self.held = rest
            elif rest:
                out.append((False, rest))
            return out
        if any(p.search(line) for p in PATTERNS.values()):
            return [*out, (True, line)]
        return [*out, (False, line)]

    def flush(self) -> list[tuple[bool, bytes]]:
        """The held text, at the end of the stream (the program never ended its line)."""
        held, self.held = self.held, b""
        return [(False, held)] if held else []
