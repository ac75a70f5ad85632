"""Where JAX's coordinator is served and reached, checked before JAX starts it.

JAX's coordination service (jaxlib 0.10) has no authentication: its gRPC server uses insecure
credentials and takes no secret, and any client that reaches it may register as any process,
which ends the job. So no process of a launched job reaches it over TCP:

- rank 0 serves it on a Unix socket in the user's private directory on its host (`private_dir()`:
  `$XDG_RUNTIME_DIR/tpudist`, else `/tmp/tpudist-<uid>`, 0700; the launcher's plan names it
  `unix:${TPUDIST_PRIVATE_DIR}/tpudist-<job>-<attempt>.sock`, `...-w0.sock` on a multi-host job,
  and each host's agent puts its directory in), created while the umask is 077, so only the job's
  user (and root) can open it, and no other user can create the path first;
- on a multi-host job the other hosts' processes reach it through the agents' gate
  (tpudist/launch/agent/_gate.py): their own host's private socket (`...-w<worker>.sock`), relayed
  to worker 0's agent at the advertised host:port (TPUDIST_COORDINATOR_GATE), which lets through only
  a connection that proves it knows the job's secret.

A job tpudist did not launch (GKE, JobSet, tpudist.spawn) names a TCP coordinator: rank 0 binds the
advertised address (not JAX's default `[::]:port`, every interface), after checking the port is free.

    bind = bind_address(job, os.environ)   # "127.0.0.2:8476", or the unix: address itself
    jax.distributed.initialize(..., coordinator_bind_address=bind)
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Iterator, Mapping

import tpudist.contract as contract

log = logging.getLogger("tpudist")

UNIX_PREFIX = "unix:"


def private_dir(environ: Mapping[str, str] = os.environ) -> str:
    """This user's private directory on this host for the job's Unix sockets: `$XDG_RUNTIME_DIR/tpudist`
    when XDG_RUNTIME_DIR is this user's own 0700 directory, else `/tmp/tpudist-<uid>`. Created 0700
    (mkdir is atomic); one that exists is used only when it is a directory (not a link) of this
    user that no one else can enter. Raises RuntimeError naming the path and what is wrong."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and _problem(runtime) is None:
        path = os.path.join(runtime, "tpudist")
    else:
        path = f"/tmp/tpudist-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RuntimeError(f"cannot create the private directory {path} for the job's sockets: {e.strerror}") from None
    if (problem := _problem(path)) is not None:
        raise RuntimeError(
            f"{path} is not a private directory of this user ({problem}): another user may have created it "
            f"to reach the job's coordinator. Remove it, or set XDG_RUNTIME_DIR to a 0700 directory of your own.")
    return path


def _problem(path: str) -> str | None:
    """Why `path` is not this user's private directory (None when it is)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return e.strerror
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):o}, open to others"
    return None


def resolve_private(value: str, environ: Mapping[str, str] = os.environ) -> str:
    """`value` with the plan's `contract.PRIVATE_DIR_TOKEN` replaced by this host's `private_dir()`."""
    token = contract.PRIVATE_DIR_TOKEN
    return value.replace(token, private_dir(environ)) if token in value else value


def is_unix(address: str | None) -> bool:
    return bool(address) and address.startswith(UNIX_PREFIX)


def split(address: str) -> tuple[str, int]:
    """`"10.0.0.2:8476"` / `"[fe80::1]:8476"` -> (host without brackets, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{contract.COORDINATOR}={address!r} is not host:port (or unix:PATH)")
    return host.strip("[]"), int(port)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bind_address(job: contract.JobEnv, environ: Mapping[str, str]) -> str:
    """What rank 0's coordinator binds: JAX_COORDINATOR_BIND_ADDRESS when set, the unix: address
    itself, else the advertised host at the advertised port (every interface only where that host
    is not one of this host's addresses, e.g. a NAT address). Raises RuntimeError naming the host
    and port when the port is taken."""
    address = job.coordinator or ""
    explicit = environ.get(contract.JAX_COORDINATOR_BIND_ADDRESS)
    if explicit and explicit != address:  # the user's own choice
        return explicit
    if is_unix(address):
        return address
    where = f"rank 0 on {job.host or split(address)[0]}"
    host, port = listen_address(address, num_workers=job.num_workers, where=where)
    return f"{_bracket(host)}:{port}" if host else f"[::]:{port}"


def listen_address(address: str, *, num_workers: int | None, where: str) -> tuple[str, int]:
    """(host, port) a server for the advertised `address` ("host:port") binds: the host itself when
    it is one of this host's addresses, else "" (every interface: a NAT address, or a name that
    resolves to loopback here). Raises RuntimeError naming `where`, the host and port when taken."""
    host, port = split(address)
    for addr in _local_candidates(host, port, num_workers):
        problem = _bind_problem(addr, port)
        if problem == errno.EADDRINUSE:
            raise RuntimeError(
                f"{where}: the JAX coordinator's port {port} is already in use on {addr or 'this host'} "
                f"(another job's coordinator, or another program), so this job did not start its own. "
                f"Pass a different --coordinator-port (or none, for a free one), or stop what holds it "
                f"(`ss -ltnp 'sport = :{port}'` shows it).")
        if problem is None and addr:
            return host, port
    log.warning("%s: the advertised %s is not an address of this host (NAT?) or resolves to loopback "
                "here; the JAX coordinator listens on every interface at port %d", where, host, port)
    return "", port


def _local_candidates(host: str, port: int, num_workers: int | None) -> list[str]:
    """The addresses binding `host` means here ("" for every interface)."""
    try:
        ipaddress.ip_address(host)
        return [host, ""]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [""]
    addrs = list(dict.fromkeys(info[4][0] for info in infos))
    # A name that resolves to loopback here (Debian's 127.0.1.1 for the own hostname) is resolved to
    # something else by the other hosts: binding it would shut them out.
    if (num_workers or 1) > 1 and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return [""]
    return addrs + [""]


def _bind_problem(addr: str, port: int) -> int | None:
    """The errno of binding (addr, port) the way a server would (SO_REUSEADDR), None when it binds."""
    family = socket.AF_INET6 if ":" in addr or not addr else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 here: the IPv4 wildcard then
        family, s = socket.AF_INET, socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr or ("::" if family == socket.AF_INET6 else ""), port))
        except OSError as e:
            return e.errno
    return None


@contextlib.contextmanager
def private_files(address: str | None) -> Iterator[None]:
    """While JAX creates a unix: coordinator's socket file: umask 077, so others cannot connect."""
    if not is_unix(address):
        yield
        return
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)
