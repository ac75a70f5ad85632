"""Secrets stay secret: `--env NAME` and `--env-file` reach every process over SSH and appear in no
command line on any host (every loopback "host" of the sshd fixture is this machine, so /proc shows
them all) and in nothing the launcher prints."""

from __future__ import annotations

import hashlib
import os
import pathlib
import secrets
import textwrap

import pytest
from launchutil import start_launcher, wait_lines

pytestmark = pytest.mark.slow

# Prints a digest of the two secrets it was given, then waits for the test to look around.
SHOW = textwrap.dedent("""
    import hashlib, os, pathlib, sys, time
    got = os.environ["TPUDIST_TEST_TOKEN"] + "|" + os.environ["DB_PASSWORD"]
    print("ready", hashlib.sha256(got.encode()).hexdigest(), flush=True)
    go = pathlib.Path(sys.argv[1])
    end = time.monotonic() + 60
    while not go.exists() and time.monotonic() < end:
        time.sleep(0.05)
""")


def _command_lines() -> list[bytes]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.append(pathlib.Path(f"/proc/{entry}/cmdline").read_bytes())
            except OSError:
                pass
    return found


def test_secrets_reach_every_host_and_no_command_line(sshd, tmp_path):
    token, password = "tok-" + secrets.token_hex(8), "pw-" + secrets.token_hex(8)
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# the database\nDB_PASSWORD={password}\n")
    go = tmp_path / "go"
    proc = start_launcher(*sshd.launcher_flags(2), "--env", "TPUDIST_TEST_TOKEN", "--env-file", str(env_file),
                          "--", "python", "-c", SHOW, str(go), env={**os.environ, "TPUDIST_TEST_TOKEN": token})
    try:
        lines = wait_lines(proc, 2, b"ready", timeout=60)
        leaked = [c for c in _command_lines() if token.encode() in c or password.encode() in c]
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    want = hashlib.sha256(f"{token}|{password}".encode()).hexdigest().encode()
    assert [line.split()[-1] for line in lines if b"ready" in line] == [want, want]  # both hosts got both
    assert leaked == []
    printed = b"".join(lines) + out + err
    assert token.encode() not in printed and password.encode() not in printed
