"""A quiet console (issue 20): the runtime's connection chatter stays off the console unless -v, goes to
--log-dir, and never splits or joins a program's line. The chatter's stand-in is the program itself
writing gloo's exact pieces, in the orders seen when gloo's threads and Python share a stdout.
A console that is a terminal (a pseudo-terminal here) tells the processes so: fit then shows progress."""

from __future__ import annotations

import os
import re
import textwrap

import pytest
from launchutil import launch, launch_on_terminal

from tpudist import contract

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


SHOW_CONSOLE = "import os; print('console=%r' % os.environ.get('TPUDIST_CONSOLE'))"


def _environ(**values: str) -> dict[str, str]:
    """This environment without TPUDIST_CONSOLE (pytest may run under a launcher), plus `values`."""
    return {**{k: v for k, v in os.environ.items() if k != contract.CONSOLE}, **values}


def test_a_terminal_console_tells_the_processes_and_a_pipe_or_quiet_does_not():
    code, console = launch_on_terminal("--local", "--", "python", "-c", SHOW_CONSOLE, env=_environ())
    assert code == 0, console.decode()
    assert b"[w0 r0 localhost] console='tty'" in console.splitlines(), console.decode()
    r = launch("--local", "--", "python", "-c", SHOW_CONSOLE, env=_environ())
    assert r.returncode == 0 and r.stdout.splitlines() == [b"[w0 r0 localhost] console=None"], r.stderr.decode()
    # --quiet: the processes' own lines only, fit's progress not among them
    code, console = launch_on_terminal("--local", "--quiet", "--", "python", "-c", SHOW_CONSOLE, env=_environ())
    assert code == 0 and b"[w0 r0 localhost] console=None" in console.splitlines(), console.decode()


def test_the_users_own_console_value_wins():
    """An exported value is passed on as it is (""): no progress by default, even on a terminal;
    `--env` wins over it, as over everything the launcher sets."""
    code, console = launch_on_terminal("--local", "--", "python", "-c", SHOW_CONSOLE,
                                       env=_environ(TPUDIST_CONSOLE=""))
    assert code == 0 and b"[w0 r0 localhost] console=''" in console.splitlines(), console.decode()
    r = launch("--local", "--env", "TPUDIST_CONSOLE=tty", "--", "python", "-c", SHOW_CONSOLE,
               env=_environ(TPUDIST_CONSOLE="pipe"))
    assert r.returncode == 0 and r.stdout.splitlines() == [b"[w0 r0 localhost] console='tty'"], r.stderr.decode()


def test_the_console_reaches_processes_over_ssh(sshd):
    """A remote process's environment is its login's, not the launcher's: the plan carries the value,
    the terminal's and an outer launcher's (the launcher's own environment) alike."""
    code, console = launch_on_terminal(*sshd.launcher_flags(1), "--", "python", "-c", SHOW_CONSOLE, env=_environ())
    assert code == 0 and b"[w0 r0 127.0.0.2] console='tty'" in console.splitlines(), console.decode()
    r = launch(*sshd.launcher_flags(1), "--", "python", "-c", SHOW_CONSOLE, env=_environ(TPUDIST_CONSOLE="tty"))
    assert r.returncode == 0 and r.stdout.splitlines() == [b"[w0 r0 127.0.0.2] console='tty'"], r.stderr.decode()


FIT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import tpudist
    tpudist.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    model = torch.nn.Linear(6, 3)
    tpudist.fit(model, torch.utils.data.DataLoader(data, batch_size=8), torch.optim.SGD(model.parameters(), lr=0.1),
                F.cross_entropy)
""")


def test_fit_shows_progress_lines_by_default_on_a_terminal_console(tmp_path):
    """What a user at a terminal sees: a progress line once the first step has compiled and run."""
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    code, console = launch_on_terminal("--local", "--", "python", str(script), env=_environ(), timeout=180)
    assert code == 0, console.decode()[-3000:]
    lines = console.splitlines()
    progress = [line for line in lines if line.startswith(b"[w0 r0 localhost] epoch 1/1: step ")]
    assert progress and re.fullmatch(rb"\[w0 r0 localhost\] epoch 1/1: step 1/4, .*examples/s", progress[0]), lines
    assert lines.index(progress[0]) > lines.index(b"[w0 r0 localhost] fit: compiling the step (its first call; "
                                                  b"the steps after reuse it) ...")
    assert any(line.startswith(b"[w0 r0 localhost] epoch 1/1: loss ") for line in lines), lines
