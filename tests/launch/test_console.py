"""A quiet console (issue 20): the runtime's connection chatter stays off the console unless -v, goes to
--log-dir, and never splits or joins a program's line. The chatter's stand-in is the program itself
writing gloo's exact pieces, in the orders seen when gloo's threads and Python share a stdout."""

from __future__ import annotations

import re
import textwrap

import pytest
from launchutil import launch

GLOO = b"[Gloo] Rank %d is connected to %d peer ranks. Expected number of connected peer ranks is : %d"

CHATTY = textwrap.dedent("""
    import os, time
    def out(*chunks):
        for c in chunks:
            os.write(1, c)
            time.sleep(0.002)   # separate writes, as separate threads make them
    gloo = b"[Gloo] Rank %d is connected to %d peer ranks. Expected number of connected peer ranks is : %d"
    # a whole message, then one inside a program line (Python writes its text and newline apart)
    out(gloo % (0, 1, 1) + b"\\n", b"step 1", gloo % (0, 1, 1) + b"\\n", b"\\n")
    # two communicators' messages cut into each other
    out(b"[Gloo] Rank 3 is connected to 3", gloo % (2, 3, 3) + b"\\n",
        b" peer ranks. Expected number of connected peer ranks is : 3\\n")
    # a lone head, another message, the head's rest, and its number at the start of a later line
    out(b"[Gloo] Rank ", gloo % (1, 1, 1) + b"\\n", b" is connected to 1 peer ranks. Expected number of "
        b"connected peer ranks is : 1\\n", b"1", b"step 2", b"\\n")
    # two messages ending together: their numbers run into each other, their newlines follow
    out(b"[Gloo] Rank 4 is connected to 3 peer ranks. Expected number of connected peer ranks is : ",
        gloo % (5, 3, 3), b"3\\n", b"\\n")
    # a lone head again, and its number leading the rest of its message
    out(b"[Gloo] Rank ", gloo % (3, 3, 3) + b"\\n", b"2 is connected to 3 peer ranks. Expected number of "
        b"connected peer ranks is : 3\\n")
    # two messages shuffled piece by piece (as seen with 2 processes: gloo's threads take turns per piece)
    out(b"[Gloo] Rank 1", b"[Gloo] Rank ", b" is connected to ", b"0", b"3", b" is connected to ", b" peer ranks. ",
        b"3", b"Expected number of connected peer ranks is : ", b" peer ranks. ", b"3",
        b"Expected number of connected peer ranks is : ", b"\\n", b"3", b"\\n")
    print(flush=True)   # the program's own empty line stays
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
    os.write(2, b"I0000 00:00:1733000000.123456    4242 service.cc:152] XLA service 0x55d initialized\\n")
    os.write(2, b"W0000 00:00:1733000000.223456    4242 thing.cc:7] a warning the user should see\\n")
    print("step 3 done", flush=True)
""")

CHATTER_PIECES = [b"[Gloo] Rank 3 is connected to 3", GLOO % (2, 3, 3), GLOO % (1, 1, 1), GLOO % (5, 3, 33),
                  b"[Gloo] Rank 1[Gloo] Rank  is connected to 03 is connected to  peer ranks. 3Expected",
                  b" peer ranks. Expected number of connected peer ranks is : 3", b"XLA service 0x55d initialized",
                  b"WARNING: All log messages before absl::InitializeLog()"]


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines()


def test_runtime_chatter_stays_off_the_console_and_goes_to_the_log_dir(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    r = launch("--nproc-per-host", "2", "--log-dir", str(tmp_path / "logs"), "--", "python", str(script))
    assert r.returncode == 0, r.stderr.decode()
    for rank in (0, 1):
        mine = [line for line in _lines(r.stdout) if line.startswith(b"[w0 r%d localhost] " % rank)]
        assert mine == [b"[w0 r%d localhost] %s" % (rank, t) for t in (b"step 1", b"step 2", b"", b"step 3 done")]
        assert [line for line in _lines(r.stderr) if line.startswith(b"[w0 r%d " % rank)] == [
            b"[w0 r%d localhost] W0000 00:00:1733000000.223456    4242 thing.cc:7] a warning the user "
            b"should see" % rank]
        log = (tmp_path / "logs" / f"rank{rank}.log").read_bytes()
        for piece in CHATTER_PIECES + [b"step 1", b"step 2", b"step 3 done", b"a warning the user"]:
            assert piece in log, piece
    assert b"Gloo" not in r.stdout + r.stderr and b"peer ranks" not in r.stdout + r.stderr
    assert all(re.match(rb"^\[w0 r[01] localhost\] ", line) for line in _lines(r.stdout) + _lines(r.stderr))


def test_verbose_shows_the_chatter_on_lines_of_its_own(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    r = launch("-v", "--", "python", str(script))
    assert r.returncode == 0, r.stderr.decode()
    console = r.stdout + r.stderr
    for piece in CHATTER_PIECES:
        assert piece in console, piece
    lines = _lines(r.stdout)
    for text in (b"step 1", b"step 2", b"step 3 done"):  # the program's lines stay whole
        assert b"[w0 r0 localhost] " + text in lines, lines
    assert lines.count(b"[w0 r0 localhost] " + GLOO % (0, 1, 1)) == 2


@pytest.mark.slow
def test_the_demo_console_has_no_gloo_line_and_every_line_prefixed():
    """The README's demo, `./scripts/demo`, with fewer steps: only the program's lines, each whole."""
    r = launch("--local", "--nproc-per-host", "2", "--cpu-devices", "2", "--", "python",
               "examples/train_dlrm.py", "--steps", "20", "--log-every", "10", timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    lines = _lines(r.stdout) + _lines(r.stderr)
    assert not [line for line in lines if b"Gloo" in line or b"peer ranks" in line], lines
    assert all(re.match(rb"^\[w0 r[01] localhost\] (dlrm: mesh|step \d+/20  loss|compiled|loss )", line)
               for line in lines), lines
    assert sum(b"step " in line for line in lines) == 2
