"""A throwaway OpenSSH server on loopback addresses, for the launcher's tests and benchmark.

`LoopbackSshd(n_hosts)` starts Debian's real `/usr/sbin/sshd` in a temporary directory with freshly
generated host and user keys. The addresses 127.0.0.2, 127.0.0.3, ... all reach this machine but
count as distinct hosts for the launcher (distinct known_hosts entries, distinct SSH connections).
sshd listens on those loopback addresses only: one sshd process per 16 addresses, because sshd
accepts at most 16 `ListenAddress` lines.

    with LoopbackSshd(4) as sshd:
        subprocess.run(["ssh", *sshd.ssh_options(), sshd.hosts[0], "true"], check=True)
        launcher_args = sshd.launcher_flags()   # --ssh-key ... --known-hosts ... --hosts ...

Used by tests/launch/conftest.py and scripts/bench_launch.py; not part of the tpudist package.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
_MAX_LISTEN = 16  # sshd's MAX_LISTEN_SOCKS


def _free_port(addresses: list[str]) -> int:
    """A port that is free on every address (probed by binding it on each)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        socks = []
        try:
            for address in addresses:
                s = socket.socket()
                socks.append(s)
                s.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no TCP port is free on all loopback test addresses")


class LoopbackSshd:
    """Real sshd serving `n_hosts` loopback addresses with generated keys; a context manager."""

    def __init__(self, n_hosts: int, *, max_startups: int = 256, clean_login: bool = True,
                 per_host: bool = False) -> None:
        if not os.path.exists(SSHD):
            raise RuntimeError(f"{SSHD} is missing; install it with `apt-get install openssh-server`")
        self.n_hosts = n_hosts
        self.addresses = [f"127.0.0.{i}" for i in range(2, n_hosts + 2)]
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="tpudist-sshd-"))
        self.port = _free_port(self.addresses)
        self.key = self.dir / "id_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self._max_startups = max_startups
        self.clean_login = clean_login and self._can_mask_rc()
        self._procs: list[subprocess.Popen] = []
        self._argvs: list[list[str]] = []
        self._group = 1 if per_host else _MAX_LISTEN  # per_host: one sshd per address, so a host can die alone

    @property
    def hosts(self) -> list[str]:
        """`host:port` of every loopback host, in order."""
        return [f"{a}:{self.port}" for a in self.addresses]

    def ssh_options(self) -> list[str]:
        """Options that make the OpenSSH client reach these hosts non-interactively."""
        return ["-p", str(self.port), "-i", str(self.key), "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "LogLevel=ERROR"]

    def launcher_flags(self, n: int | None = None) -> list[str]:
        """`tpudist.xla_dist` flags that reach the first `n` hosts (all by default)."""
        hosts = ",".join(self.addresses[: n or self.n_hosts])
        return ["--hosts", hosts, "--ssh-port", str(self.port), "--ssh-key", str(self.key),
                "--known-hosts", str(self.known_hosts)]

    def start(self) -> "LoopbackSshd":
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        shutil.copy(f"{self.key}.pub", self.dir / "authorized_keys")
        host_pub = (self.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        self.known_hosts.write_text("".join(f"[{a}]:{self.port} {' '.join(host_pub)}\n" for a in self.addresses))
        # sshd refuses to start without its privilege separation directory.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for i in range(0, len(self.addresses), self._group):
            group = self.addresses[i: i + self._group]
            config = self.dir / f"sshd_config.{i // self._group}"
            config.write_text("\n".join([
                f"Port {self.port}",
                *(f"ListenAddress {a}" for a in group),
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.dir}/authorized_keys",
                f"PidFile {self.dir}/sshd.{i // self._group}.pid",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "UseDNS no",
                "AllowTcpForwarding yes",
                "Subsystem sftp internal-sftp",  # as Debian's default config (sftp-server) offers it
                "GatewayPorts no",
                "X11Forwarding no",
                "PrintMotd no",
                "LogLevel ERROR",
                f"MaxStartups {self._max_startups}",
                "MaxSessions 64",
                "", ]))
            argv = [SSHD, "-D", "-e", "-f", str(config)]
            if self.clean_login:
                argv = [*self._masking_prefix(), *argv]
            self._argvs.append(argv)
            self._procs.append(self._spawn(argv))
        self._wait_listening(deadline=time.monotonic() + 15)
        return self

    # bash sources ~/.bashrc for every command sshd runs. This machine's root .bashrc runs
    # `pyenv init`, whose rehash takes a global lock: it serialises every SSH session, whatever the
    # client. With clean_login, sshd runs in a private mount namespace where ~/.bashrc is an empty
    # file, like a fresh VM's login; the real file is untouched. Falls back when unshare is not allowed.
    _RC = os.path.expanduser("~/.bashrc")

    @classmethod
    def _can_mask_rc(cls) -> bool:
        if not os.path.exists(cls._RC) or not shutil.which("unshare"):
            return False
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                f'mount --bind /dev/null "{cls._RC}"'], capture_output=True)
        return probe.returncode == 0

    def _masking_prefix(self) -> list[str]:
        empty = self.dir / "empty_bashrc"
        empty.write_text("")
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" "$1" && shift && exec "$@"', str(empty), self._RC]

    def _wait_listening(self, deadline: float) -> None:
        pending = list(self.addresses)
        while pending:
            for proc in self._procs:
                if proc.poll() is not None:
                    log = (self.dir / "sshd.log").read_text(errors="replace")
                    self.stop()
                    raise RuntimeError(f"sshd exited with {proc.returncode}:\n{log}")
            try:
                socket.create_connection((pending[0], self.port), timeout=1).close()
                pending.pop(0)
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"sshd is not listening on {pending[0]}:{self.port} after 15 s")
                time.sleep(0.05)

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(self.dir / "sshd.log", "ab"))

    def revive_host(self, index: int) -> None:
        """per_host: host `index`'s sshd listens again (after `kill_host`)."""
        self._procs[index] = self._spawn(self._argvs[index])
        self._wait_listening(deadline=time.monotonic() + 15)

    def kill_host(self, index: int) -> None:
        """per_host: host `index`'s sshd stops listening for good (sessions it already runs go on)."""
        assert self._group == 1, "kill_host needs LoopbackSshd(per_host=True)"
        proc = self._procs[index]
        proc.kill()
        proc.wait(timeout=5)

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackSshd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
