"""Jobs on this machine (--local): output, fail-fast, Ctrl-C, the launcher dying, restarts, conda.

The local agent speaks the same gRPC protocol as a remote one; only SSH is left out.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from launchutil import alive, describe, family, launch, pids_with, start_launcher, wait_lines, wait_until

pytestmark = pytest.mark.slow

SLEEPER = "import sys, time; print('ready', flush=True); time.sleep(120)"


def test_every_line_arrives_whole_prefixed_and_on_its_own_stream(tmp_path):
    # Two processes at once, lines short and far longer than a pipe's atomic write (PIPE_BUF).
    n_lines = 120
    width = [70_000 if i % 3 == 0 else 40 for i in range(n_lines)]
    code = textwrap.dedent(f"""
        import os, sys
        r = os.environ["RANK"]
        width = {width!r}
        for i in range({n_lines}):
            print(f"out-{{r}}-{{i}}-" + "o" * width[i])
            print(f"err-{{r}}-{{i}}-" + "e" * width[i], file=sys.stderr)
    """)
    r = launch("--nproc-per-host", "2", "--log-dir", str(tmp_path / "logs"), "--", "python", "-c", code)
    assert r.returncode == 0, r.stderr[-2000:]
    for stream, kind, fill in ((r.stdout, "out", "o"), (r.stderr, "err", "e")):
        pattern = re.compile(rf"^\[w0 r(\d) localhost\] {kind}-(\d)-(\d+)-({fill}*)$")
        seen: dict[int, list[int]] = {0: [], 1: []}
        for line in stream.decode().splitlines():
            m = pattern.match(line)
            assert m, f"cut, mixed or misplaced line on std{kind}: {line[:120]!r}"
            assert m[1] == m[2] and len(m[4]) == width[int(m[3])]  # whole, and from the rank in the prefix
            seen[int(m[1])].append(int(m[3]))
        assert seen == {0: list(range(n_lines)), 1: list(range(n_lines))}
    for rank in (0, 1):  # one file per rank, both streams, without the console prefix
        lines = (tmp_path / "logs" / f"rank{rank}.log").read_text().splitlines()
        assert sorted(lines) == sorted([f"out-{rank}-{i}-" + "o" * width[i] for i in range(n_lines)]
                                       + [f"err-{rank}-{i}-" + "e" * width[i] for i in range(n_lines)])


def test_ranks_filter_and_prefix_template():
    r = launch("--nproc-per-host", "3", "--ranks-filter", "0,2", "--log-prefix", "<{rank}/{local_rank}@{host}> ",
               "--", "python", "-c", "import os; print('hi from', os.environ['RANK'])")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.decode().splitlines()) == ["<0/0@localhost> hi from 0", "<2/2@localhost> hi from 2"]


def test_fail_fast_stops_the_others_and_exits_with_the_root_cause(marker, no_leftovers):
    code = textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            def train_step():
                raise RuntimeError("loss is nan at step 3")
            train_step()
        print("ready", flush=True)
        time.sleep(120)
    """)
    r = launch("--nproc-per-host", "3", "--", "python", "-c", code, marker, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    table = err[err.index("tpudist: the job failed"):]
    assert re.search(r"localhost\s+0\s+1\s+exit 1\s+\S+\s+<- root cause", table), table
    assert len(re.findall(r"SIGTERM \(stopped\)", table)) == 2, table
    assert "RuntimeError: loss is nan at step 3" in table.split("root cause (first observed failure)")[1]


def test_death_by_signal_is_reported_with_128_plus_the_signal(marker, no_leftovers):
    code = "import os, signal, time; os.environ['RANK'] == '0' and os.kill(os.getpid(), signal.SIGKILL); time.sleep(60)"
    r = launch("--nproc-per-host", "2", "--", "python", "-c", code, marker, timeout=60)
    assert r.returncode == 128 + signal.SIGKILL
    assert re.search(r"localhost\s+0\s+0\s+SIGKILL\s+\S+\s+<- root cause", r.stderr.decode())


def test_missing_command_is_a_clear_failure():
    r = launch("--", "no-such-command-xyz", "arg", timeout=60)
    assert r.returncode == 127
    assert "command not found: no-such-command-xyz" in r.stderr.decode()


def test_ctrl_c_stops_everything_and_exits_130(marker, no_leftovers):
    proc = start_launcher("--nproc-per-host", "2", "--", "python", "-c", SLEEPER, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert b"stopped by SIGINT" in proc.stderr.read()
    finally:
        proc.kill()


def test_second_ctrl_c_kills_at_once(marker, no_leftovers):
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(300)")
    proc = start_launcher("--nproc-per-host", "2", "--stop-grace", "120", "--", "python", "-c", stubborn, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=60)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the processes ignore SIGTERM, so the grace period runs
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # long before the 120 s grace period ends
    finally:
        proc.kill()


def test_launcher_sigkilled_its_processes_stop(marker, no_leftovers):
    proc = start_launcher("--nproc-per-host", "2", "--", "python", "-c", SLEEPER, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=60)
        assert len(pids_with(marker)) == 3  # the launcher and its two processes
        started = family(proc.pid)  # the agent and the processes
        assert len(started) >= 3, describe(started)
        proc.kill()
        proc.wait(timeout=10)
        assert wait_until(lambda: not alive(started), timeout=15), describe(alive(started))
    finally:
        proc.kill()


# A signal arriving at random moments while the agent's main thread waits for its run to end;
# each round a one-shot timer's handler ends the run, as SIGTERM's does in the agent. Some waits
# are shorter than the time a wait takes to begin, so their deadline passes inside the wait.
_ENDING_UNDER_SIGNALS = """
import random, signal, sys, time
from tpudist.launch.agent._agent import Ending
rng, rounds, end = random.Random(0), 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    ending = Ending()
    signal.signal(signal.SIGALRM, lambda *_: ending.finish("SIGTERM"))
    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 5e-4))
    while not ending.wait(rng.choice((1e-6, 2e-4))):
        pass
    assert ending.reason == "SIGTERM"
    rounds += 1
print(rounds)
"""


def test_the_agent_ends_on_a_signal_arriving_at_any_moment():
    """The agent ends its run from SIGTERM's handler, which Python runs between any two bytecodes
    of the main thread, lock held or not: thousands of signals at random moments, each must end a
    wait. Both earlier forms hung here within seconds: a handler calling `threading.Event.set`
    (deadlock on the lock its own thread held), and a wait on `queue.SimpleQueue.get` whose
    deadline passed inside the call (CPython 3.11 then waits with no deadline at all)."""
    try:
        r = subprocess.run([sys.executable, "-c", _ENDING_UNDER_SIGNALS, "4"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("a signal's handler could not end the agent's run: its wait never returned")
    assert r.returncode == 0, r.stderr.decode()
    assert int(r.stdout) > 1000


def test_max_restarts_runs_the_job_again_with_the_attempt_number(marker):
    code = ("import os; a = os.environ['TPUDIST_RESTART']; print('attempt', a, 'rank', os.environ['RANK']); "
            "raise SystemExit(42 if a == '0' and os.environ['RANK'] == '1' else 0)")  # 42: restart me
    r = launch("--nproc-per-host", "2", "--max-restarts", "2", "--", "python", "-c", code, marker, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "attempt 1 rank 0" in out and "attempt 1 rank 1" in out and "attempt 2" not in out
    assert "restarting (1/2 restarts)" in r.stderr.decode()


def test_a_restarted_attempt_outlives_the_previous_attempts_stop_grace(marker):
    # Attempt 0 fails at once and is stopped with a 1 s grace; attempt 1 starts well inside that
    # second and runs past it: the first stop's delayed SIGKILL must not reach it.
    code = ("import os, time; a = os.environ['TPUDIST_RESTART']\n"
            "if a == '0': raise SystemExit(42 if os.environ['RANK'] == '1' else time.sleep(30))\n"
            "time.sleep(2.5); print('attempt', a, 'rank', os.environ['RANK'], 'done', flush=True)")
    r = launch("--nproc-per-host", "2", "--max-restarts", "1", "--stop-grace", "1", "--",
               "python", "-c", code, marker, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "attempt 1 rank 0 done" in out and "attempt 1 rank 1 done" in out, out


def test_exhausted_restarts_report_the_last_failure(marker):
    r = launch("--max-restarts", "1", "--", "python", "-c", "raise SystemExit(42)", marker, timeout=90)
    assert r.returncode == 42
    assert r.stderr.decode().count("<- root cause") == 2  # one table per failed attempt


@pytest.fixture
def conda_stand_in(tmp_path):
    """A stand-in for conda (which cannot be installed here): `conda shell.posix activate NAME`
    prints the export lines the real one prints for an env under tmp_path/envs/NAME."""
    env_bin = tmp_path / "envs" / "torch-xla-1.6" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "python").symlink_to(sys.executable)
    conda = tmp_path / "condabin" / "conda"
    conda.parent.mkdir()
    conda.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        # stand-in for conda: only `shell.posix activate NAME`
        [ "$1" = shell.posix ] && [ "$2" = activate ] || exit 2
        prefix="{tmp_path}/envs/$3"
        [ -d "$prefix" ] || {{ echo "EnvironmentNameNotFound: $3" >&2; exit 1; }}
        echo "export PATH='$prefix/bin':\\"\\$PATH\\""
        echo "export CONDA_PREFIX='$prefix'"
        echo "export CONDA_DEFAULT_ENV='$3'"
    """))
    conda.chmod(conda.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{conda.parent}:{os.environ['PATH']}"}, env_bin


def test_conda_env_runs_the_command_inside_it(conda_stand_in):
    env, env_bin = conda_stand_in
    code = "import os, shutil; print(os.environ['CONDA_DEFAULT_ENV'], shutil.which('python'), os.environ['RANK'])"
    r = launch("--conda-env=torch-xla-1.6", "--env", "ANY_ENV_VAR=VALUE", "--", "python", "-c", code, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split("] ", 1)[1].split() == ["torch-xla-1.6", str(env_bin / "python"), "0"]


def test_unknown_conda_env_fails_with_the_name(conda_stand_in):
    env, _ = conda_stand_in
    r = launch("--conda-env=nope", "--", "python", "-c", "pass", env=env)
    assert r.returncode == 127
    assert "EnvironmentNameNotFound: nope" in r.stderr.decode()


def test_sigusr1_is_forwarded_to_every_process(marker, no_leftovers):
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (print('got USR1', os.environ['RANK'], flush=True), sys.exit(0)))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n"
            "sys.exit(1)")
    proc = start_launcher("--nproc-per-host", "2", "--", "python", "-c", code, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=60)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=30) == 0  # both processes handled the signal and exited 0
        assert sorted(re.findall(rb"got USR1 (\d)", proc.stdout.read())) == [b"0", b"1"]
    finally:
        proc.kill()
