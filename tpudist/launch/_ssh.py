"""SSH to one host with paramiko: ~/.ssh/config, known_hosts checking, and the control-port forward.

`connect` resolves the host through ~/.ssh/config (HostName, User, Port, IdentityFile, ProxyCommand),
logs in with the given key, the SSH agent or the default keys, and checks the host key against
known_hosts: an unknown key is refused (`HostKeyUnknown`, naming the host and --accept-new-host-keys)
unless `accept_new` is set, and a changed key is always refused. Every step has a timeout.

`forward_control_port` asks the host's sshd to listen on its 127.0.0.1:<port> and carries each
connection there back over this SSH connection to the launcher's control server.
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Callable

import paramiko

from tpudist.launch.config import SshOptions
from tpudist.launch.clusters import Host

_known_hosts_lock = threading.Lock()
# paramiko logs every failed handshake with a traceback; SshError says what went wrong instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False


class SshError(Exception):
    """Reaching or logging in to a host failed; the message names the host and the fix."""


GCLOUD_KEY = "~/.ssh/google_compute_engine"  # the key gcloud creates and authorizes on Compute/TPU VMs


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and as whom a Host is reached, after ~/.ssh/config and the flags."""

    hostname: str
    port: int
    user: str
    keys: tuple[str, ...]
    proxy_command: str | None
    known_hosts: str


def resolve(host: Host, opts: SshOptions, config: paramiko.SSHConfig) -> Target:
    """Applies the precedence OpenSSH uses: the host's own user/port, then the flags, then the config."""
    cfg = config.lookup(host.address)
    # beside paramiko's own ~/.ssh/id_*: the config's IdentityFile, then the key `gcloud compute ssh`
    # made (TPU VMs authorize it through project or instance metadata)
    keys = (opts.key,) if opts.key else tuple(dict.fromkeys(
        p for p in (os.path.expanduser(k) for k in [*cfg.get("identityfile", []), GCLOUD_KEY]) if os.path.exists(p)))
    known = opts.known_hosts or os.path.expanduser(
        (cfg.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0])
    return Target(hostname=cfg.get("hostname", host.address),
                  port=int(host.port or opts.port or cfg.get("port", 22)),
                  user=host.user or opts.user or cfg.get("user") or getpass.getuser(),
                  keys=keys, proxy_command=cfg.get("proxycommand"), known_hosts=known)


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, host: Host, known_hosts: str) -> None:
        self.host, self.known_hosts = host, known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        raise SshError(f"host {self.host}: its {key.get_name()} host key ({_fingerprint(key)}) is not in "
                       f"{self.known_hosts}. Check it and rerun with --accept-new-host-keys to add it "
                       "(like OpenSSH's StrictHostKeyChecking=accept-new), or add it with ssh-keyscan.")


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:  # hosts connect in parallel; each appends one whole line
            os.makedirs(os.path.dirname(self.known_hosts) or ".", exist_ok=True)
            with open(self.known_hosts, "a", encoding="ascii") as f:
                f.write(line)


_parsed_known_hosts: dict[str, tuple[tuple[int, int], paramiko.HostKeys]] = {}


def _known_hosts(path: str) -> paramiko.HostKeys:
    """The known_hosts file at `path`, parsed once per version of the file (empty if absent).

    Hosts connect in parallel; parsing an N-line file once per host would cost O(N^2) key parses
    for N hosts (~7 ms per connection at 64 lines, seconds of launcher CPU at hundreds of hosts).
    A file appended to (--accept-new-host-keys) has a new size and is parsed again."""
    try:
        st = os.stat(path)
    except OSError:
        return paramiko.HostKeys()
    stamp = (st.st_mtime_ns, st.st_size)
    with _known_hosts_lock:
        cached = _parsed_known_hosts.get(path)
        if cached is None or cached[0] != stamp:
            cached = _parsed_known_hosts[path] = (stamp, paramiko.HostKeys(path))
        return cached[1]


def _fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


def connect(host: Host, opts: SshOptions, config: paramiko.SSHConfig) -> paramiko.SSHClient:
    """An authenticated SSH connection to `host`. Raises SshError naming the host and the fix."""
    target = resolve(host, opts, config)
    client = paramiko.SSHClient()
    # the name paramiko looks the server's key up by
    name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
    files = ["/etc/ssh/ssh_known_hosts"] if opts.known_hosts is None else []
    for path in files + [target.known_hosts]:
        found = _known_hosts(path).lookup(name)
        for key_type, key in (found or {}).items():
            client.get_host_keys().add(name, key_type, key)
    client.set_missing_host_key_policy(
        _AcceptNew(target.known_hosts) if opts.accept_new else _RefuseUnknown(host, target.known_hosts))
    where = f"host {host} ({target.user}@{target.hostname}:{target.port})"
    t = opts.connect_timeout
    t0 = time.monotonic()
    transports: list[paramiko.Transport] = []

    def transport(sock, **kw) -> paramiko.Transport:
        # paramiko waits 15 s for the key exchange whatever the other timeouts say
        made = paramiko.Transport(sock, **kw)
        made.handshake_timeout = t
        transports.append(made)
        return made

    try:
        sock = paramiko.ProxyCommand(target.proxy_command) if target.proxy_command else None
        client.connect(target.hostname, port=target.port, username=target.user,
                       key_filename=list(target.keys) or None, look_for_keys=not opts.key,
                       allow_agent=True, timeout=t, banner_timeout=t, auth_timeout=t, channel_timeout=t,
                       sock=sock, transport_factory=transport)
    except SshError:
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        # `name`, as known_hosts has it: `[host]:port` unless the port is 22
        raise SshError(f"{where}: its host key ({_fingerprint(e.key)}) differs from the one in "
                       f"{target.known_hosts}. This can be an attack; if the host was reinstalled, remove "
                       f"the old key with `ssh-keygen -R {shlex.quote(name)} -f "
                       f"{shlex.quote(target.known_hosts)}`.") from None
    except paramiko.AuthenticationException as e:
        client.close()
        raise SshError(_auth_failed(where, target, e)) from None
    except paramiko.ssh_exception.NoValidConnectionsError as e:
        client.close()
        reasons = sorted({err.strerror or str(err) for err in e.errors.values()})
        raise SshError(f"{where}: cannot connect: {'; '.join(reasons)}. Is sshd running there and "
                       "the port right (--ssh-port, host:port, ~/.ssh/config)?") from None
    except (socket.timeout, TimeoutError) as e:
        client.close()
        if stalled := _after_banner(where, transports, time.monotonic() - t0, t, e):
            raise SshError(stalled) from None
        raise SshError(f"{where}: no SSH answer within --connect-timeout {t:g} s; is the host up "
                       "and its SSH port reachable?") from None
    except socket.gaierror as e:
        client.close()
        raise SshError(f"{where}: cannot resolve {target.hostname}: {e.strerror}") from None
    except (OSError, EOFError, paramiko.SSHException) as e:
        client.close()
        if stalled := _after_banner(where, transports, time.monotonic() - t0, t, e):
            raise SshError(stalled) from None
        # The port answered TCP but no SSH server spoke in time (paramiko words this several ways).
        if "protocol banner" in str(e) or time.monotonic() - t0 >= t * 0.9:
            raise SshError(f"{where}: no SSH answer within --connect-timeout {t:g} s; is an SSH server "
                           "listening on that port?") from None
        if "authentication methods" in str(e):  # no key anywhere: not even one was offered
            raise SshError(_auth_failed(where, target, e)) from None
        detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise SshError(f"{where}: cannot connect: {detail}") from None
    return client


def _after_banner(where: str, transports: list[paramiko.Transport], took: float, t: float,
                  error: BaseException) -> str:
    """What went wrong when the server sent its SSH banner but the key exchange never finished ("":
    it did finish, or no banner came)."""
    kex = transports[0] if transports else None
    if kex is None or not kex.remote_version or kex.initial_kex_done:
        return ""
    if took >= t * 0.9:  # an overloaded sshd (MaxStartups), a middlebox holding the connection
        return (f"{where}: the SSH server sent its banner ({kex.remote_version}) and then stalled in the key "
                f"exchange; gave up after --connect-timeout {t:g} s. Is the host overloaded, or something "
                "between here and there holding the connection?")
    detail = str(error) or type(error).__name__
    return (f"{where}: the SSH server sent its banner ({kex.remote_version}) and then closed the connection "
            f"during the key exchange ({detail}); its sshd log says why (MaxStartups, no common algorithm).")


def _auth_failed(where: str, target: Target, error: Exception) -> str:
    tried = ", ".join(target.keys) or "the SSH agent and ~/.ssh/id_*"
    return (f"{where}: authentication failed ({error}); tried {tried}. Pass --ssh-key FILE, "
            "--ssh-user, or add the key to the SSH agent.")


def forward_control_port(client: paramiko.SSHClient, local_port: Callable[[], int]) -> int:
    """Makes the host's 127.0.0.1:<returned port> reach the launcher's 127.0.0.1:`local_port()`."""
    transport = client.get_transport()
    assert transport is not None

    def accept(channel: paramiko.Channel, origin, server) -> None:
        threading.Thread(target=_pump, args=(channel, local_port), daemon=True).start()

    port = transport.request_port_forward("127.0.0.1", 0, handler=accept)
    if not port:
        raise SshError("the host's sshd refused the remote port forward for the control channel; "
                       "allow it with `AllowTcpForwarding yes` (or `remote`) in its sshd_config")
    return port


def _pump(channel: paramiko.Channel, local_port: Callable[[], int]) -> None:
    """Copies bytes both ways between a forwarded channel and the local control server."""
    try:
        sock = socket.create_connection(("127.0.0.1", local_port()), timeout=5)
    except (OSError, TimeoutError):
        _close(channel)
        return
    sock.settimeout(None)

    def upstream() -> None:  # host -> launcher
        try:
            while data := channel.recv(65536):
                sock.sendall(data)
        except OSError:
            pass
        finally:
            _shutdown(sock)

    t = threading.Thread(target=upstream, daemon=True)
    t.start()
    try:
        while data := sock.recv(65536):  # launcher -> host
            channel.sendall(data)
    except (OSError, EOFError):
        pass
    finally:
        _close(channel)
        t.join(timeout=5)
        sock.close()


def _close(channel: paramiko.Channel) -> None:
    # closing sends a message on the SSH connection, which may already be gone at teardown
    try:
        channel.close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
