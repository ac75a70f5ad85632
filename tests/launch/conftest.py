"""Fixtures for the launcher's tests: a real OpenSSH server on loopback hosts, and leftover checks.

`sshd` (session-wide) runs Debian's /usr/sbin/sshd for 127.0.0.2 .. 127.0.0.5 with generated host and
user keys (scripts/_sshd.py); it is stopped when the session ends. Helpers live in launchutil.py.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
from launchutil import describe, pids_with, wait_until

from _sshd import LoopbackSshd

N_HOSTS = 4


@pytest.fixture(scope="session")
def sshd():
    if not os.path.exists("/usr/sbin/sshd") or not shutil.which("ssh-keygen"):
        pytest.skip("openssh-server is not installed (apt-get install openssh-server openssh-client)")
    server = LoopbackSshd(N_HOSTS).start()
    yield server
    server.stop()


@pytest.fixture
def marker() -> str:
    return f"tpudist-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def no_leftovers(marker):
    """Fails the test if any process carrying its marker is still alive shortly after it ends."""
    yield
    if not wait_until(lambda: not pids_with(marker), timeout=10):
        left = pids_with(marker)
        described = describe(left)  # before the kill: whose child each one was, and in what state
        for pid in left:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        pytest.fail(f"processes of the job outlived it:\n{described}")
