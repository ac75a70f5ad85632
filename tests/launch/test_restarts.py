"""--max-restarts by cause (--restart-on), on this machine with real processes.

What a user relies on: under the default `--restart-on infra` a job is run again after what running
again can fix (a signal such as the OOM killer's SIGKILL or a preemption's SIGTERM, exit 42, exit
128+), never after the program's own error, and the launcher says which it was; `--restart-on any`
restarts that too. Every restart names its cause, and a job that succeeded after restarts says so.
The lost host and the dropped SSH connection, which need SSH, are in test_chaos.py.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from launchutil import launch, start_launcher, wait_lines

# Fails on its first attempt (TPUDIST_RESTART=0) as rank 1, by FAIL; every rank prints its attempt.
JOB = ("import os, signal, sys\n"
       "a, rank = os.environ['TPUDIST_RESTART'], os.environ['RANK']\n"
       "print('attempt', a, 'rank', rank, flush=True)\n"
       "if a == '0' and rank == '1':\n"
       "    {fail}\n")


def _run(fail: str, marker: str, *flags: str):
    r = launch("--nproc-per-host", "2", "--stop-grace", "1", *flags, "--", "python", "-c",
               JOB.format(fail=fail), marker, timeout=60)
    return r, r.stdout.decode(), r.stderr.decode()


def test_a_python_exception_is_not_restarted_and_the_launcher_says_why(marker):
    r, out, err = _run("raise ValueError('bad config')", marker, "--max-restarts", "2")
    assert r.returncode == 1, err
    assert "attempt 1 rank" not in out and "restarting (" not in err, err
    assert "ValueError: bad config" in err
    assert err.rstrip().splitlines()[-1] == (
        "tpudist: not restarting: rank 1 exited 1 (an error in the program); --restart-on any restarts it")


def test_restart_on_any_restarts_a_python_exception(marker):
    r, out, err = _run("raise ValueError('bad config')", marker, "--max-restarts", "2", "--restart-on", "any")
    assert r.returncode == 0, err
    assert "attempt 1 rank 0" in out and "attempt 1 rank 1" in out and "attempt 2" not in out
    assert "tpudist: attempt 1 failed; restarting (1/2 restarts): rank 1 exited 1 (an error in the program)" in err
    assert err.rstrip().splitlines()[-1] == (
        "tpudist: the job succeeded on attempt 2, after 1 restart: rank 1 exited 1 (an error in the program)")


INFRA = {
    "os.kill(os.getpid(), signal.SIGKILL)":  # what the OOM killer does
        "rank 1 was killed by SIGKILL (the OOM killer, a preemption or a kill -9)",
    "os.kill(os.getpid(), signal.SIGTERM)":  # a preemption: SIGTERM from outside the launcher
        "rank 1 was killed by SIGTERM (sent from outside the launcher: a preemption?)",
    "sys.exit(42)": "rank 1 exited 42 (asks to be restarted)",
    "sys.exit(137)": "rank 1 exited 137 (128+9: a signal)",  # a wrapper shell reporting a SIGKILL
}


@pytest.mark.parametrize("fail", list(INFRA))
def test_infra_failures_restart_by_default_each_naming_its_cause(fail, marker):
    r, out, err = _run(fail, marker, "--max-restarts", "1")
    assert r.returncode == 0, err
    assert "attempt 1 rank 0" in out and "attempt 1 rank 1" in out, out
    assert f"tpudist: attempt 1 failed; restarting (1/1 restarts): {INFRA[fail]}" in err, err
    assert err.rstrip().splitlines()[-1] == f"tpudist: the job succeeded on attempt 2, after 1 restart: {INFRA[fail]}"


def test_the_last_table_counts_the_restarts_and_says_none_are_left(marker):
    always = "import os, sys\nprint('attempt', os.environ['TPUDIST_RESTART'], flush=True)\nsys.exit(42)"
    r = launch("--max-restarts", "2", "--", "python", "-c", always, marker, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 42, err
    assert re.findall(r"attempt (\d)", r.stdout.decode()) == ["0", "1", "2"]
    assert "tpudist: the job failed; every other process was stopped (attempt 3, after 2 restarts)" in err, err
    assert err.rstrip().splitlines()[-1] == "tpudist: not restarting: all 2 restarts of --max-restarts 2 are used"


def test_restart_on_rejects_an_unknown_value(marker):
    r = launch("--restart-on", "infra,sometimes", "--", "true", marker, timeout=30)
    assert r.returncode == 2
    assert ("--restart-on 'infra,sometimes' must be one or more of infra, hang, any, comma-separated "
            "(e.g. infra,hang)") in r.stderr.decode()


HANG = "import time; time.sleep(600)"  # silent: no progress for --hang-timeout


def test_a_hang_restarts_under_restart_on_hang(marker):
    r, out, err = _run(HANG, marker, "--max-restarts", "1", "--restart-on", "infra,hang", "--hang-timeout", "3")
    assert r.returncode == 0, err
    assert "attempt 1 rank 0" in out and "attempt 1 rank 1" in out, out
    assert ("tpudist: attempt 1 failed; restarting (1/1 restarts): rank 1 hung (no progress for "
            "--hang-timeout)") in err, err


def test_a_hang_is_not_restarted_under_restart_on_infra_and_the_launcher_says_how(marker):
    r, out, err = _run(HANG, marker, "--max-restarts", "1", "--hang-timeout", "3")
    assert r.returncode == 124, err
    assert "attempt 1 rank" not in out, out
    assert err.rstrip().splitlines()[-1] == (
        "tpudist: not restarting: rank 1 hung (no progress for --hang-timeout); --restart-on infra,hang restarts it")


def test_sigterm_to_the_launcher_stops_the_job_without_a_restart(marker):
    # SIGTERM to the launcher (not to a rank) means "stop": no restart, whatever --restart-on says.
    proc = start_launcher("--max-restarts", "3", "--restart-on", "any", "--", "python", "-c",
                          "import time; print('ready', flush=True); time.sleep(60)", marker)
    try:
        wait_lines(proc, 1, b"ready", timeout=30)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert b"restarting" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(timeout=10)
