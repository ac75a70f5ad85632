"""The TPU preflight (issue 20): `tpudist doctor` and every host's agent, before anything starts, report
a TPU held by another process (PID, command line, `sudo kill`) and a stale libtpu lock file
(`sudo rm`). There is no TPU here, so the device nodes are stand-ins: regular files under the test's
tmp directory named like TPU device nodes (TPUDIST_TPU_DEVICES points at them), a stand-in holder
(a process that keeps one open, as libtpu keeps /dev/accel0 open), and a stand-in lock file
(TPUDIST_LIBTPU_LOCKFILE). The check itself is the real one: /proc/<pid>/fd of every process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launchutil import launch, wait_until

from tpudist import contract


@pytest.fixture
def tpu(tmp_path):
    """Stand-in TPU device nodes (accel0, accel1) and where the stand-in lock file goes."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in (0, 1):
        (dev / f"accel{n}").write_bytes(b"")
    env = {**os.environ, contract.TPU_DEVICES: f"{dev}/accel*", contract.LIBTPU_LOCKFILE: str(tmp_path / "libtpu_lockfile")}
    return dev, tmp_path / "libtpu_lockfile", env


@pytest.fixture
def holder(tpu, marker):
    """A stand-in for a process using the TPU: it holds the stand-in /dev/accel1 open."""
    dev, _, _ = tpu
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                             "print('holding', flush=True); time.sleep(120)", str(dev / "accel1"), marker],
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"holding\n"
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def _doctor(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpudist", "doctor", "--local"], capture_output=True, text=True,
                          timeout=60, env=env)


def test_doctor_says_a_free_tpu_is_free(tpu):
    r = _doctor(tpu[2])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"tpu: 2 device node(s): {tpu[0]}/accel0, {tpu[0]}/accel1; free" in r.stdout


def test_doctor_names_the_process_holding_the_tpu_and_the_fix(tpu, holder, marker):
    r = _doctor(tpu[2])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NOT FREE" in r.stdout
    line = next(line for line in r.stdout.splitlines() if line.strip().startswith("busy:"))
    assert f"{tpu[0]}/accel1 is held by PID {holder.pid} (" in line and marker in line
    assert line.endswith(f"fix: sudo kill {holder.pid}")


def test_doctor_finds_a_stale_lock_file_and_the_fix(tpu):
    _, lockfile, env = tpu
    lockfile.write_text("")
    r = _doctor(env)
    assert r.returncode == 1
    assert f"stale-lock: stale libtpu lock file {lockfile}" in r.stdout
    assert r.stdout.rstrip().endswith(f"fix: sudo rm {lockfile}")


def test_a_host_without_tpu_device_nodes_is_not_checked(tmp_path):
    env = {**os.environ, contract.TPU_DEVICES: f"{tmp_path}/accel*"}
    r = _doctor(env)
    assert r.returncode == 0 and "no TPU device node on this host" in r.stdout


@pytest.mark.slow
def test_a_busy_tpu_stops_the_launch_on_every_host_before_anything_starts(sshd, tpu, holder, tmp_path, marker):
    _, _, env = tpu
    ran = tmp_path / "ran"
    program = ["python", "-c", "import sys; open(sys.argv[1], 'a').write('x')", str(ran), marker]
    r = launch(*sshd.launcher_flags(2), "--", *program, env=env)
    err = r.stderr.decode()
    assert r.returncode == 255, err
    assert "the TPU of 2 of 2 hosts is not free, so nothing was started" in err
    for host in ("127.0.0.2", "127.0.0.3"):  # the loopback hosts share this machine, and its holder
        assert f"host {host}: {tpu[0]}/accel1 is held by PID {holder.pid} (" in err
    assert f"fix: sudo kill {holder.pid}" in err and "--skip-preflight" in err and marker in err
    assert not ran.exists()
    r = launch(*sshd.launcher_flags(2), "--skip-preflight", "--", *program, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert ran.read_text() == "xx"


def test_a_stale_lock_file_stops_a_local_launch(tpu, tmp_path):
    _, lockfile, env = tpu
    lockfile.write_text("")
    ran = tmp_path / "ran"
    r = launch("--", "python", "-c", "import sys; open(sys.argv[1], 'w')", str(ran), env=env)
    err = r.stderr.decode()
    assert r.returncode == 255 and not ran.exists(), err
    assert f"host localhost: stale libtpu lock file {lockfile}" in err and f"fix: sudo rm {lockfile}" in err
    lockfile.unlink()
    assert launch("--", "python", "-c", "import sys; open(sys.argv[1], 'w')", str(ran), env=env).returncode == 0
    assert wait_until(ran.exists, timeout=5)


def test_a_pinned_coordinator_port_in_use_stops_the_launch_before_any_host_is_touched():
    # Nothing listens for SSH on 127.0.0.3/4 here: the check comes first, so the error is the port's.
    import socket
    import time

    with socket.socket() as held:
        held.bind(("127.0.0.3", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        r = launch("--hosts", "127.0.0.3,127.0.0.4", "--coordinator-port", str(port), "--", "true", timeout=60)
        took = time.monotonic() - start
    assert r.returncode == 2, r.stderr.decode()
    assert f"--coordinator-port {port} is in use on 127.0.0.3: another job's JAX coordinator".encode() in r.stderr
    assert b"Pass another --coordinator-port, or none" in r.stderr and took < 10
