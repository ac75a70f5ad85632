"""Jobs over real SSH: a real sshd (tests/launch/conftest.py) serves 127.0.0.2 .. 127.0.0.5 as four hosts.

Every process of every "host" runs on this machine, so `pids_with(marker)` sees all of them: a job
leaves nothing behind when no process carrying its marker survives it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from launchutil import launch, pids_with, start_launcher, wait_lines, wait_until

pytestmark = pytest.mark.slow

SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"


def _env_of(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ")


PSUM = textwrap.dedent("""
    import os
    import numpy as np
    import torch
    import tpudist
    job = tpudist.init()
    rank = tpudist.process_index()
    assert (rank, tpudist.process_count()) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (job.rank, 8)
    total = tpudist.all_reduce(torch.arange(1, 4, dtype=torch.float32) * (rank + 1.0))
    gathered = tpudist.all_gather(np.array([rank], np.int64))
    assert gathered.tolist() == list(range(8)), gathered
    print("PSUM", rank, os.environ["TPUDIST_HOST"], " ".join(repr(float(v)) for v in total), flush=True)
""")


def test_collective_across_4_hosts_x_2_processes(sshd, tmp_path):
    script = tmp_path / "psum.py"
    script.write_text(PSUM)
    r = launch(*sshd.launcher_flags(), "--nproc-per-host", "2", "--", "python", str(script), timeout=240)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    expected = sum((rank + 1.0) * np.arange(1, 4, dtype=np.float32) for rank in range(8))  # numpy reference
    results = {}
    for line in r.stdout.decode().splitlines():
        m = re.match(r"^\[w(\d) r(\d) (\S+)\] PSUM (\d) (\S+) (.*)$", line)
        if m:
            worker, rank, host = int(m[1]), int(m[2]), m[3]
            assert rank == int(m[4]) and worker == rank // 2 and host == m[5] == f"127.0.0.{2 + worker}"
            results[rank] = np.array([float(v) for v in m[6].split()])
    assert sorted(results) == list(range(8)), r.stdout.decode()
    for total in results.values():
        np.testing.assert_allclose(total, expected)


HOSTILE = ["plain", "two words", "it's", '"double"', "semi;colon && echo INJECTED", "$(touch {pwned})",
           "`touch {pwned}`", "new\nline", "tab\there", "ünïcødé ✓ 日本", "", "*", "~", "back\\slash",
           "$HOME", "--", "-c", "trailing space "]


def test_argv_and_env_arrive_byte_exact(sshd, tmp_path, marker):
    pwned = tmp_path / "pwned"
    argv = [a.format(pwned=pwned) for a in HOSTILE]
    env_values = {f"HOSTILE_{i}": a for i, a in enumerate(argv) if a}  # an env value cannot be empty-named
    dump = tmp_path / "dump"
    dump.mkdir()
    script = tmp_path / "dump.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        env = {{k.decode(): v.hex() for k, v in os.environb.items()}}
        json.dump({{"argv": [os.fsencode(a).hex() for a in sys.argv[1:]], "env": env, "cwd": os.getcwd()}},
                  open(os.path.join({str(dump)!r}, os.environ["RANK"] + ".json"), "w"))
    """))
    env_flags = [f for k, v in env_values.items() for f in ("--env", f"{k}={v}")]
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    r = launch(*sshd.launcher_flags(2), *env_flags, "--workdir", str(workdir), "--cpu-devices", "2",
               "--", "python", str(script), *argv, marker)
    assert r.returncode == 0, r.stderr.decode()
    for rank in (0, 1):
        got = json.loads((dump / f"{rank}.json").read_text())
        assert [bytes.fromhex(a) for a in got["argv"]] == [a.encode() for a in [*argv, marker]]
        env = {k: bytes.fromhex(v) for k, v in got["env"].items()}
        for k, v in env_values.items():
            assert env[k] == v.encode(), k
        assert got["cwd"] == str(workdir)
        assert env["PATH"].split(b":")[0] == os.path.dirname(sys.executable).encode()
        assert env["RANK"] == str(rank).encode() and env["TPUDIST_HOST"] == f"127.0.0.{2 + rank}".encode()
        assert env["TPUDIST_CPU_DEVICES"] == b"2"
    assert not pwned.exists(), "a shell evaluated part of the user's argv"


def test_fail_fast_over_ssh_leaves_nothing_running(sshd, marker, no_leftovers):
    code = ("import os, time; r = os.environ['RANK']; time.sleep(1.0)\n"
            "if r == '5': raise SystemExit(3)\n"
            "time.sleep(120)")
    t0 = time.monotonic()
    r = launch(*sshd.launcher_flags(), "--nproc-per-host", "2", "--", "python", "-c", code, marker, timeout=90)
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert re.search(r"127\.0\.0\.4\s+2\s+5\s+exit 3\s+\S+\s+<- root cause", err), err
    assert len(re.findall(r"SIGTERM \(stopped\)", err)) == 7, err
    assert time.monotonic() - t0 < 60


def test_ctrl_c_over_ssh(sshd, marker, no_leftovers):
    proc = start_launcher(*sshd.launcher_flags(), "--", "python", "-c", SLEEPER, marker)
    try:
        wait_lines(proc, 4, b"ready", timeout=90)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()


def test_launcher_sigkilled_remote_agents_stop_their_processes(sshd, marker, no_leftovers):
    proc = start_launcher(*sshd.launcher_flags(), "--", "python", "-c", SLEEPER, marker)
    try:
        wait_lines(proc, 4, b"ready", timeout=90)
        proc.kill()
        proc.wait(timeout=10)
        assert wait_until(lambda: not pids_with(marker), timeout=20), pids_with(marker)
    finally:
        proc.kill()


def test_killed_ssh_session_stops_that_host_and_fails_the_job(sshd, marker, no_leftovers):
    proc = start_launcher(*sshd.launcher_flags(), "--", "python", "-c", SLEEPER, marker)
    try:
        wait_lines(proc, 4, b"ready", timeout=90)
        [victim] = [p for p in pids_with(marker) if _env_of(p).get(b"TPUDIST_HOST") == b"127.0.0.3"]
        agent = _ppid(victim)
        session = _ppid(agent)
        assert b"tpudist.launch.agent" in _cmdline(agent) and b"sshd" in _cmdline(session)
        os.kill(session, signal.SIGKILL)
        assert wait_until(lambda: not os.path.exists(f"/proc/{victim}"), timeout=15)
        assert proc.wait(timeout=30) == 255
        err = proc.stderr.read().decode()
        assert re.search(r"127\.0\.0\.3\s+1\s+1\s+lost .*<- root cause", err), err
    finally:
        proc.kill()


def test_unknown_host_key_is_refused_unless_accepted(sshd, tmp_path, marker):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    flags = [f if f != str(sshd.known_hosts) else str(empty) for f in sshd.launcher_flags(2)]
    r = launch(*flags, "--", "python", "-c", "print('ran')", marker)
    err = r.stderr.decode()
    assert r.returncode == 255 and b"ran" not in r.stdout
    assert "host 127.0.0.2:" in err and "host 127.0.0.3:" in err and "--accept-new-host-keys" in err
    assert empty.read_text() == ""  # never a silent add
    r = launch(*flags, "--accept-new-host-keys", "--", "python", "-c", "print('ran')", marker)
    assert r.returncode == 0 and r.stdout.count(b"ran") == 2, r.stderr.decode()
    added = sorted(line.split()[0] for line in empty.read_text().splitlines())
    assert added == [f"[127.0.0.2]:{sshd.port}", f"[127.0.0.3]:{sshd.port}"]


def test_changed_host_key_is_refused_even_with_accept_new(sshd, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.2]:{sshd.port} {' '.join(pathlib.Path(f'{other}.pub').read_text().split()[:2])}\n")
    flags = [f if f != str(sshd.known_hosts) else str(known) for f in sshd.launcher_flags(1)]
    r = launch(*flags, "--accept-new-host-keys", "--", "true")
    assert r.returncode == 255 and "differs from the one in" in r.stderr.decode()


def test_wrong_key_is_an_authentication_error_naming_the_host(sshd, tmp_path):
    stranger = tmp_path / "id_stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    flags = [f if f != str(sshd.key) else str(stranger) for f in sshd.launcher_flags(1)]
    r = launch(*flags, "--", "true")
    assert r.returncode == 255
    assert re.search(r"host 127\.0\.0\.2 .*authentication failed", r.stderr.decode()), r.stderr.decode()


def test_silent_host_fails_within_the_connect_timeout(sshd):
    silent = socket.socket()  # accepts TCP connections and never says a word of SSH
    silent.bind(("127.0.0.6", 0))
    silent.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    try:
        t0 = time.monotonic()
        r = launch(*sshd.launcher_flags(2), "--hosts", f"127.0.0.2,127.0.0.6:{silent.getsockname()[1]}",
                   "--connect-timeout", "2", "--", "true")
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    err = r.stderr.decode()
    assert r.returncode == 255 and "host 127.0.0.6:" in err and "--connect-timeout 2 s" in err, err
    assert "127.0.0.2" not in err.split("hosts:")[1]  # the reachable host is not blamed
    assert elapsed < 30


def test_closed_port_is_a_clear_error(sshd):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        closed = s.getsockname()[1]
    r = launch(*sshd.launcher_flags(1), "--ssh-port", str(closed), "--", "true")
    assert r.returncode == 255
    assert re.search(rf"host 127\.0\.0\.2 .*:{closed}\): cannot connect: .*refused", r.stderr.decode())


def test_missing_python_on_a_host_is_named(sshd, marker):
    r = launch(*sshd.launcher_flags(2), "--python", "/nonexistent/bin/python3", "--", "true", marker)
    err = r.stderr.decode()
    assert r.returncode == 255
    for host in ("127.0.0.2", "127.0.0.3"):
        assert re.search(rf"host {host}: the agent exited with status 127 .* /nonexistent/bin/python3 is missing",
                         err), err


def test_ssh_config_user_port_identity_and_hostname(sshd, tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("".join(
        f"Host worker{i}\n  HostName 127.0.0.{2 + i}\n  Port {sshd.port}\n  User root\n"
        f"  IdentityFile {sshd.key}\n  UserKnownHostsFile {sshd.known_hosts}\n" for i in range(2)))
    shutil.copy(sshd.known_hosts, home / ".ssh" / "known_hosts")
    code = "import os; print(os.environ['TPUDIST_HOST'], os.environ['MASTER_ADDR'], os.environ['SSH_CONNECTION'].split()[2])"
    r = launch("--hosts", "worker0,worker1", "--", "python", "-c", code, env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0, r.stderr.decode()
    lines = sorted(line.split("] ", 1)[1] for line in r.stdout.decode().splitlines())
    assert lines == ["worker0 127.0.0.2 127.0.0.2", "worker1 127.0.0.2 127.0.0.3"]


def test_version_skew_across_hosts_is_a_warning(sshd, tmp_path):
    # A stand-in for a host with another jax: the agent's interpreter on 127.0.0.3 sees jax 0.0.1 metadata.
    fake = tmp_path / "fakejax" / "jax-0.0.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.0.1\n")
    wrapper = tmp_path / "bin" / "python-skewed"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase "$SSH_CONNECTION" in *" 127.0.0.3 "*) '
                       f'export PYTHONPATH={fake.parent};; esac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    r = launch(*sshd.launcher_flags(2), "--python", str(wrapper), "--", "true")
    assert r.returncode == 0, r.stderr.decode()
    [warning] = [line for line in r.stderr.decode().splitlines() if "versions differ" in line]
    assert "jax" in warning and "0.0.1 on 127.0.0.3" in warning and "on 127.0.0.2" in warning


def test_ssh_agent_key_and_hostfile_slots(sshd, tmp_path):
    home = tmp_path / "home"  # no ~/.ssh keys here: only the SSH agent holds the key
    home.mkdir()
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        assert wait_until(sock.exists, timeout=10)
        env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", "-q", str(sshd.key)], env=env, check=True, timeout=30)
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# two workers\n127.0.0.2:{sshd.port} slots=2\n\n127.0.0.3:{sshd.port} slots=1\n")
        code = "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['TPUDIST_HOST'])"
        r = launch("--hostfile", str(hostfile), "--known-hosts", str(sshd.known_hosts), "--",
                   "python", "-c", code, env=env)
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    assert r.returncode == 0, r.stderr.decode()
    lines = sorted(line.split("] ", 1)[1] for line in r.stdout.decode().splitlines())
    assert lines == ["0 0 127.0.0.2", "1 1 127.0.0.2", "2 0 127.0.0.3"]


def test_gclouds_key_is_tried_without_ssh_key(sshd, tmp_path, marker):
    # a TPU user's only key is often the one `gcloud compute ssh` made: no --ssh-key, no ~/.ssh/config
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(sshd.key, home / ".ssh" / "google_compute_engine")
    flags = [f for f in sshd.launcher_flags(1)]
    at = flags.index("--ssh-key")
    del flags[at:at + 2]
    env = {**os.environ, "HOME": str(home)}
    env.pop("SSH_AUTH_SOCK", None)
    r = launch(*flags, "--", "python", "-c", "print('reached')", marker, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert b"reached" in r.stdout
    (home / ".ssh" / "google_compute_engine").unlink()  # and without it: refused, naming the host
    r = launch(*flags, "--", "python", "-c", "print('reached')", marker, env=env)
    assert r.returncode != 0 and b"127.0.0.2" in r.stdout + r.stderr
