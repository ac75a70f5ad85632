"""Faults, against a real sshd with 2 loopback hosts: each job must end cleanly, fast, leaving nothing.

Every test asserts the launcher's exit status, the failure table's root-cause line, the time the
job took to end and that no process of it is left in the process table: neither one whose argv
carries the job's marker nor one whose environment does (a daemon a process forked, or one it
exec'ed). Deadlines are generous (2 busy cores) but bounded, and far below the failure modes they
guard against (a 300 s JAX shutdown barrier, a 3 s SIGKILL grace, a second per held pipe).
docs/launcher.md ("Faults") has the times these jobs take.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import textwrap
import threading
import time

import pytest
from launchutil import environ_of, job_pids, launch, parent_of, start_launcher, wait_lines, wait_until

pytestmark = pytest.mark.slow

# A daemon: fork, setsid (its own session and process group), fork, the middle process exits. It
# inherits the worker's stdout and stderr, so it also holds the pipes the agent reads.
DAEMON = textwrap.dedent("""
    import os, sys, time
    def daemon():
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(600)
            os._exit(0)
        os.waitpid(child, 0)
""")


@pytest.fixture
def nothing_left(marker):
    """Asserts after the test that no process of the job is alive; kills any (by pid) if one is."""
    yield lambda timeout=2.0: wait_until(lambda: not job_pids(marker), timeout=timeout)
    left = job_pids(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the job outlived it: {left}"


def _flags(sshd, marker: str, *extra: str) -> list[str]:
    return [*sshd.launcher_flags(2), "--env", f"CHAOS_MARKER={marker}", *extra]


def _table(err: str) -> str:
    return err[err.index("host "):]


def test_launcher_sigkilled_every_process_and_daemon_stops(sshd, marker, nothing_left):
    code = DAEMON + "daemon(); print('ready', flush=True); time.sleep(600)"
    proc = start_launcher(*_flags(sshd, marker, "--nproc-per-host", "2"), "--", "python", "-c", code, marker)
    try:
        wait_lines(proc, 4, b"ready", timeout=90)
        assert len(job_pids(marker)) >= 8  # 4 processes and their 4 daemons (and the launcher)
        t0 = time.monotonic()
        proc.kill()
        proc.wait(timeout=10)
        assert nothing_left(timeout=10), job_pids(marker)  # agents: stdin EOF, SIGTERM, 2 s, SIGKILL
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()


def test_launcher_sigterm_stops_the_job_with_143(sshd, marker, nothing_left):
    code = DAEMON + "daemon(); print('ready', flush=True); time.sleep(600)"
    proc = start_launcher(*_flags(sshd, marker), "--", "python", "-c", code, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=90)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        took = time.monotonic() - t0
        err = proc.stderr.read().decode()
        assert "tpudist: stopped by SIGTERM; every process was stopped" in err, err
        assert len(re.findall(r"SIGTERM \(stopped\)", _table(err))) == 2, err
        assert "root cause" not in err  # an interrupt has no root cause
        assert took < 5, took
        assert nothing_left(timeout=2.0), job_pids(marker)
    finally:
        proc.kill()


def test_killed_ssh_session_fails_the_job_naming_the_lost_host(sshd, marker, nothing_left):
    code = "import time; print('ready', flush=True); time.sleep(600)"
    proc = start_launcher(*_flags(sshd, marker, "--nproc-per-host", "2"), "--", "python", "-c", code, marker)
    try:
        wait_lines(proc, 4, b"ready", timeout=90)
        worker1 = [p for p in job_pids(marker) if environ_of(p).get(b"TPUDIST_HOST") == b"127.0.0.3"
                   and environ_of(p).get(b"RANK") == b"2"]
        session = parent_of(parent_of(worker1[0]))  # worker -> agent -> sshd session
        t0 = time.monotonic()
        os.kill(session, signal.SIGKILL)
        assert proc.wait(timeout=30) == 255
        took = time.monotonic() - t0
        err = proc.stderr.read().decode()
        assert re.search(r"root cause \(first observed failure\): rank [23] on 127\.0\.0\.3 \(worker 1\): "
                         r"lost \(host agent gone", err), err
        assert len(re.findall(r"127\.0\.0\.2\s+0\s+[01]\s+SIGTERM \(stopped\)", err)) == 2, err
        assert took < 15, took
        assert nothing_left(timeout=10), job_pids(marker)
    finally:
        proc.kill()


def test_daemon_holding_the_pipes_neither_delays_fail_fast_nor_survives(sshd, marker, nothing_left):
    # Every process leaves a daemon holding its stdout/stderr; rank 0 then fails. The exit report
    # must not wait for pipes only a daemon still holds (before: about 1 s per pipe, 2 per process),
    # and no daemon may outlive the job (before: each ran on under PID 1).
    code = DAEMON + textwrap.dedent("""
        daemon()
        print("ready", flush=True)
        if os.environ["RANK"] == "0":
            time.sleep(1.5)
            print("failing at", time.time(), flush=True)
            sys.exit(3)
        time.sleep(600)
    """)
    r = launch(*_flags(sshd, marker, "--nproc-per-host", "2"), "--", "python", "-c", code, marker, timeout=90)
    ended = time.time()
    err, out = r.stderr.decode(), r.stdout.decode()
    assert r.returncode == 3, err
    assert re.search(r"127\.0\.0\.2\s+0\s+0\s+exit 3\s+\S+\s+<- root cause", err), err
    assert len(re.findall(r"SIGTERM \(stopped\)", _table(err))) == 3, err
    failed_at = float(re.search(r"failing at (\S+)", out)[1])
    assert ended - failed_at < 3.0, f"the launcher ended {ended - failed_at:.1f} s after rank 0 failed"
    assert nothing_left(timeout=2.0), f"daemons alive 2 s after the job: {job_pids(marker)}"


STUCK = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import tpudist
    tpudist.init()
    rank = tpudist.process_index()
    tpudist.all_reduce(np.ones(4, np.float32))
    print("before the collective", time.time(), flush=True)
    if rank == 3:
        time.sleep(600)  # never arrives
    tpudist.all_reduce(np.ones(4, np.float32))
""")


def test_a_rank_stuck_before_a_collective_ends_the_job_within_the_timeout(sshd, tmp_path, marker, nothing_left):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    timeout = 4
    r = launch(*_flags(sshd, marker, "--nproc-per-host", "2", "--cpu-devices", "1", "--env",
                       f"TPUDIST_COLLECTIVE_TIMEOUT={timeout}"), "--", "python", str(script), marker, timeout=180)
    ended = time.time()
    err, out = r.stderr.decode(), r.stdout.decode()
    assert r.returncode == 1, err[-3000:]
    root = err[err.index("root cause (first observed failure)"):]
    assert re.match(r"root cause \(first observed failure\): rank [012] on 127\.0\.0\.[23] \(worker [01]\): exit 1",
                    root), root
    assert "CollectiveTimeout" in root and "ranks [3] did not arrive" in root, root
    started = max(float(t) for t in re.findall(r"before the collective (\S+)", out))
    assert ended - started < timeout + 10, f"ended {ended - started:.1f} s after the collective began"
    assert "SIGKILL" not in _table(err), err  # the stuck rank too left by itself on SIGTERM
    assert re.search(r"127\.0\.0\.3\s+1\s+3\s+exit 143 \(stopped\)", err), err
    assert nothing_left(timeout=5), job_pids(marker)


INIT_AND_WAIT = textwrap.dedent("""
    import atexit, os, time
    import numpy as np
    import tpudist
    tpudist.init()
    rank = tpudist.process_index()
    atexit.register(lambda: print("atexit", rank, flush=True))
    tpudist.all_reduce(np.ones(4, np.float32))
    try:
        print("ready", flush=True)
        time.sleep(600)
    finally:
        print("finally", rank, flush=True)
""")


def test_ctrl_c_on_init_processes_lets_each_exit_by_itself(sshd, tmp_path, marker, nothing_left):
    # Before: JAX's preemption notifier took SIGTERM over, so every process ran on until SIGKILL.
    script = tmp_path / "wait.py"
    script.write_text(INIT_AND_WAIT)
    proc = start_launcher(*_flags(sshd, marker, "--nproc-per-host", "2", "--cpu-devices", "1"),
                          "--", "python", str(script), marker)
    try:
        lines = wait_lines(proc, 4, b"ready", timeout=150)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        took = time.monotonic() - t0
        out = b"".join(lines).decode() + proc.stdout.read().decode()
        err = proc.stderr.read().decode()
        table = _table(err)
        assert len(re.findall(r"exit 143 \(stopped\)", table)) == 4, err  # not SIGKILL, not SIGTERM
        assert took < 3.0 + 2.0, took  # within --stop-grace (3 s), with room for the reports
        assert sorted(re.findall(r"finally (\d)", out)) == ["0", "1", "2", "3"], out
        assert sorted(re.findall(r"atexit (\d)", out)) == ["0", "1", "2", "3"], out
        assert nothing_left(timeout=5), job_pids(marker)
    finally:
        proc.kill()


def test_output_flood_arrives_line_for_line(sshd, tmp_path, marker, nothing_left):
    n = 40_000
    big = 1 << 20  # exactly the agent's line limit: one line, not split
    script = tmp_path / "flood.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        r = os.environ["RANK"].encode()
        out, err = sys.stdout.buffer, sys.stderr.buffer
        for i in range({n}):
            out.write(b"o " + r + b" %d\\n" % i)
            if i % 4 == 0:
                err.write(b"e " + r + b" %d\\n" % i)
        out.write(b"B" * {big} + b"\\n")
        out.write(b"raw " + r + b" \\xff\\xfe\\x80 end\\n")
        out.write(b"last " + r)  # no newline at the end
        out.flush()
        err.flush()
    """))
    t0 = time.monotonic()
    r = launch(*_flags(sshd, marker, "--log-prefix", "{rank}|"), "--", "python", str(script), marker, timeout=180)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in (b"0", b"1"):
        out = [line.split(b"|", 1)[1] for line in r.stdout.split(b"\n") if line.startswith(rank + b"|")]
        err = [line.split(b"|", 1)[1] for line in r.stderr.split(b"\n") if line.startswith(rank + b"|")]
        assert [x for x in out if x.startswith(b"o ")] == [b"o " + rank + b" %d" % i for i in range(n)]
        assert err == [b"e " + rank + b" %d" % i for i in range(0, n, 4)]
        assert [x for x in out if x.startswith(b"B")] == [b"B" * big]
        assert b"raw " + rank + b" \xff\xfe\x80 end" in out and out[-1] == b"last " + rank
        assert len(out) == n + 3
    assert took < 90, took
    assert nothing_left(), job_pids(marker)


def test_a_dropped_ssh_connection_restarts_the_job_over_a_new_one(sshd, marker, nothing_left):
    # Before: the restarted attempt sent its Start to the lost host's dead session and waited forever.
    code = ("import os, time; a = os.environ['TPUDIST_RESTART']; print('ready', a, os.environ['RANK'], "
            "flush=True); time.sleep(600 if a == '0' else 0)")
    proc = start_launcher(*_flags(sshd, marker, "--max-restarts", "1"), "--", "python", "-c", code, marker)
    try:
        wait_lines(proc, 2, b"ready 0", timeout=90)
        worker1 = [p for p in job_pids(marker) if environ_of(p).get(b"TPUDIST_HOST") == b"127.0.0.3"
                   and environ_of(p).get(b"RANK") == b"1"]
        t0 = time.monotonic()
        os.kill(parent_of(parent_of(worker1[0])), signal.SIGKILL)  # worker -> agent -> its sshd session
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
        assert code == 0, err[-3000:]
        assert "ready 1 0" in out and "ready 1 1" in out, out  # both hosts ran the second attempt
        assert ("tpudist: attempt 1 failed; restarting (1/1 restarts): rank 1's host 127.0.0.3 was lost "
                "(host agent gone: SSH connection lost)") in err, err
        assert "tpudist: the job succeeded on attempt 2, after 1 restart" in err, err
        assert took < 30, took
        assert nothing_left(timeout=10), job_pids(marker)
    finally:
        proc.kill()


def test_an_interpreter_hung_at_startup_leaves_nothing_after_start_timeout(sshd, tmp_path, marker, nothing_left):
    # A stand-in interpreter stuck before the agent runs (as one blocked on a dead NFS import), with
    # a child: the agent's own watchdogs never start, so the launcher must kill what it started.
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexport CHAOS_MARKER={marker}\nsleep 600 &\nexec sleep 601\n")
    python.chmod(0o755)
    t0 = time.monotonic()
    r = launch(*_flags(sshd, marker, "--python", str(python), "--start-timeout", "3"), "--", "true", timeout=60)
    took = time.monotonic() - t0
    err = r.stderr.decode()
    assert r.returncode == 255, err
    assert "no agent report within --start-timeout 3 s from 127.0.0.2, 127.0.0.3: " in err, err
    assert f"the agent command ({python} -m tpudist.launch.agent) runs there but the agent never reported" in err
    assert took < 20, took
    assert nothing_left(timeout=2.0), f"left on the hosts after --start-timeout: {job_pids(marker)}"


class _StallAfterBanner(threading.Thread):
    """A TCP server on a loopback address that sends an SSH banner, then nothing (an overloaded sshd)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []

    def run(self) -> None:
        try:
            while True:
                conn, _ = self.sock.accept()
                conn.sendall(b"SSH-2.0-x\r\n")
                self.held.append(conn)
        except OSError:  # closed
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("timeout", [2, 16])  # 16: past paramiko's own 15 s for the key exchange
def test_a_host_that_stalls_after_its_banner_is_named_after_connect_timeout(tmp_path, timeout):
    server = _StallAfterBanner("127.0.0.9")
    server.start()
    try:
        t0 = time.monotonic()
        r = launch("--hosts", f"127.0.0.9:{server.port}", "--known-hosts", str(tmp_path / "known_hosts"),
                   "--connect-timeout", str(timeout), "--", "true", timeout=60)
        took = time.monotonic() - t0
    finally:
        server.close()
    err = r.stderr.decode()
    assert r.returncode == 255, err
    assert (f"host 127.0.0.9:{server.port} (" in err and "the SSH server sent its banner (SSH-2.0-x) and then "
            f"stalled in the key exchange; gave up after --connect-timeout {timeout} s") in err, err
    assert timeout <= took < timeout + 6, took


def test_the_changed_host_key_hint_removes_the_host_port_entry(sshd, tmp_path):
    # The fixture's hosts listen on a port other than 22: known_hosts holds them as [host]:port.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "old")], check=True)
    old_key = " ".join((tmp_path / "old.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    entry = f"[127.0.0.2]:{sshd.port}"
    known.write_text(f"{entry} {old_key}\n")
    flags = [str(known) if f == str(sshd.known_hosts) else f for f in sshd.launcher_flags(1)]
    r = launch(*flags, "--", "true", timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 255 and "differs from the one in" in err, err
    hint = re.search(r"`(ssh-keygen -R [^`]+)`", err)[1]
    assert hint == f"ssh-keygen -R '{entry}' -f {known}", hint
    subprocess.run(hint, shell=True, check=True, capture_output=True, timeout=30)
    left = subprocess.run(["ssh-keygen", "-F", entry, "-f", str(known)], capture_output=True, timeout=30)
    assert not left.stdout.strip(), f"the hint left the old key in place: {left.stdout.decode()}"
