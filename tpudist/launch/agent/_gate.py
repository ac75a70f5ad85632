"""The JAX coordinator's gate: on a multi-host job only the job's own hosts reach the coordinator.

JAX's coordination service takes no secret (tpudist/_coordinator.py), so no process reaches it over
TCP. Rank 0 serves it on a private Unix socket on worker 0, and the agents relay bytes to it:

- the agent with rank 0 listens on the advertised host:port (TPUDIST_COORDINATOR_GATE). It sends
  each connection a random challenge, which must be answered with HMAC-SHA256 of it under a key
  derived from the job's token (which reached the agents on stdin over SSH, never a command line)
  within AUTH_TIMEOUT_S; a connection that does not is closed and its source address said once.
- every other agent listens on its host's private Unix socket (the processes' TPUDIST_COORDINATOR,
  mode 0600) and relays each connection there to the gate, answering its challenge.

JAX's gRPC then runs over the Unix sockets and the relayed connections; one thread moves all the
bytes (`_Pump`). The gate is set up for each attempt's Start and closed with it and with the agent.

    gate = Gate(token, host="10.0.0.2", say=print)
    gate.configure(start)   # from the Start message: nothing unless TPUDIST_COORDINATOR_GATE is set
    gate.close()
"""

from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable

import tpudist._coordinator as _coordinator
import tpudist.contract as contract

MAGIC = b"tpudist coordinator gate 1\n"  # what a gate says first, with its challenge
NONCE_BYTES = 16
AUTH_TIMEOUT_S = 5.0  # to prove (or check) the secret, once connected
CONNECT_WAIT_S = 120.0  # how long a relayed connection waits for its far end (rank 0, the gate) to listen
RETRY_S = 0.02
_BUFFER = 1 << 18  # per direction of a relayed connection: reading stops while it is full
_SAID_MAX = 20  # refusals said, one line per source address


def job_key(token: str) -> bytes:
    """The gate's key: derived from the job's control-plane token, never the token itself."""
    return hmac.new(token.encode(), b"tpudist jax coordinator gate", hashlib.sha256).digest()


def proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _connect(family: int, address, deadline: float, stopped: threading.Event) -> socket.socket:
    """Connects, retrying while nothing listens there yet (the far end is still starting)."""
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, min(AUTH_TIMEOUT_S, deadline - time.monotonic())))
        try:
            sock.connect(address)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() + RETRY_S > deadline or stopped.is_set():
                raise
            stopped.wait(RETRY_S)
        except OSError:
            sock.close()
            raise


class Gate:
    """One agent's part of the gate for the current attempt (see the module docstring)."""

    def __init__(self, token: str, *, host: str, say: Callable[[str], None]) -> None:
        self.key = job_key(token)
        self.host, self.say = host, say
        self._listener: socket.socket | None = None
        self._unix_path = ""
        self._stopped = threading.Event()
        self._pump: _Pump | None = None
        self._said: set[str] = set()

    def configure(self, start) -> None:
        """Closes the previous attempt's gate and opens this one's, as the Start's processes need.
        Raises RuntimeError (naming the host, address and fix) when it cannot listen."""
        self.close()
        specs = list(start.processes)
        env = {v.name.decode(): v.value.decode() for v in specs[0].env} if specs else {}
        gate, local = env.get(contract.COORDINATOR_GATE), env.get(contract.COORDINATOR, "")
        if not gate or not _coordinator.is_unix(local):
            return  # a one-host job (its coordinator socket is rank 0's own), or not launched by tpudist
        path = _coordinator.resolve_private(local)[len(_coordinator.UNIX_PREFIX):]  # raises RuntimeError
        self._stopped = threading.Event()
        self._pump = _Pump()
        try:
            if any(spec.rank == 0 for spec in specs):  # rank 0 serves the coordinator at `path` itself
                self._listener, serve, target = self._listen_tcp(gate), self._admit, path
            else:
                self._listener, serve, target = self._listen_unix(path), self._relay, gate
        except RuntimeError:
            self.close()
            raise
        threading.Thread(target=self._accept, args=(self._listener, serve, target, self._stopped),
                         daemon=True, name="tpudist-gate-accept").start()

    def close(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            try:  # stops listening now: a thread polling it keeps the socket open until it wakes
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        if self._unix_path:
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
            self._unix_path = ""
        if self._pump is not None:
            self._pump.close()
            self._pump = None

    def _listen_tcp(self, gate: str) -> socket.socket:
        where = f"the agent of rank 0 on {self.host}"
        host, port = _coordinator.listen_address(gate, num_workers=2, where=where)
        family = socket.AF_INET6 if ":" in host or not host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: the IPv4 wildcard then
            family, sock = socket.AF_INET, socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host or ("::" if family == socket.AF_INET6 else ""), port))
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"{where}: cannot listen for the job's hosts at {gate} (the JAX coordinator's "
                               f"gate): {e.strerror}. Pass another --coordinator-port.") from None
        return sock

    def _listen_unix(self, path: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(path) and stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_uid == os.getuid():
                os.unlink(path)  # our own, left by an agent that was killed
            sock.bind(path)
            self._unix_path = path
            os.chmod(path, 0o600)  # before listen(): no one can connect while it is still open to all
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the agent on {self.host}: cannot create the JAX coordinator's socket {path}: "
                               f"{e.strerror}. Remove the file if it is left over.") from None
        return sock

    def _accept(self, listener: socket.socket, serve, target: str, stopped: threading.Event) -> None:
        listener.settimeout(0.5)
        while not stopped.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            threading.Thread(target=serve, args=(conn, peer, target, stopped), daemon=True,
                             name="tpudist-gate-conn").start()

    def _admit(self, conn: socket.socket, peer, path: str, stopped: threading.Event) -> None:
        """Worker 0: a connection from the network gets in only with the job's secret."""
        source = f"{_coordinator._bracket(peer[0])}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(AUTH_TIMEOUT_S)
            conn.sendall(MAGIC + nonce)
            answer = _recv_exactly(conn, hashlib.sha256().digest_size, time.monotonic() + AUTH_TIMEOUT_S)
            why = "" if hmac.compare_digest(answer, proof(self.key, nonce)) else "a wrong job secret"
        except TimeoutError:
            why = f"no job secret within {AUTH_TIMEOUT_S:g} s"
        except OSError as e:  # ConnectionError included
            why = f"it closed without the job secret ({type(e).__name__})"
        if why:
            conn.close()
            if peer[0] not in self._said and len(self._said) < _SAID_MAX:
                self._said.add(peer[0])
                self.say(f"tpudist agent on {self.host}: refused a connection to this job's JAX coordinator "
                         f"from {source}: {why}; only the job's own hosts get in")
            return
        try:
            upstream = _connect(socket.AF_UNIX, path, time.monotonic() + CONNECT_WAIT_S, stopped)
        except OSError as e:
            conn.close()
            if not stopped.is_set():
                self.say(f"tpudist agent on {self.host}: rank 0's JAX coordinator {path} did not listen within "
                         f"{CONNECT_WAIT_S:g} s ({e}); a process of {source} was let in but not through")
            return
        self._hand_over(conn, upstream, stopped)

    def _relay(self, conn: socket.socket, _peer, gate: str, stopped: threading.Event) -> None:
        """Every other host: a local process's connection, taken to worker 0's gate with the secret."""
        host, port = _coordinator.split(gate)
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            upstream = _connect(info[0], info[4], time.monotonic() + CONNECT_WAIT_S, stopped)
            try:
                hello = _recv_exactly(upstream, len(MAGIC) + NONCE_BYTES, time.monotonic() + AUTH_TIMEOUT_S)
                if not hello.startswith(MAGIC):
                    raise ConnectionError(f"{gate} is not a tpudist coordinator gate (it said {hello[:16]!r})")
                upstream.settimeout(AUTH_TIMEOUT_S)
                upstream.sendall(proof(self.key, hello[len(MAGIC):]))
            except BaseException:
                upstream.close()
                raise
        except (OSError, ConnectionError) as e:
            conn.close()
            if not stopped.is_set() and "relay" not in self._said:
                self._said.add("relay")
                self.say(f"tpudist agent on {self.host}: cannot reach the JAX coordinator's gate at {gate} "
                         f"(worker 0's agent): {e}")
            return
        self._hand_over(conn, upstream, stopped)

    def _hand_over(self, a: socket.socket, b: socket.socket, stopped: threading.Event) -> None:
        pump = self._pump
        if stopped.is_set() or pump is None or not pump.add(a, b):
            a.close()
            b.close()


class _End:
    __slots__ = ("sock", "peer", "out", "eof", "events")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.peer, self.out, self.eof, self.events = sock, None, bytearray(), False, 0


class _Pump:
    """Moves bytes both ways between paired sockets, every pair on one thread (a selector)."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[tuple[_End, _End]] = []
        self._closed = False
        self._ends: set[_End] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tpudist-gate-pump")
        self._thread.start()

    def add(self, a: socket.socket, b: socket.socket) -> bool:
        """Starts relaying between `a` and `b` (whose ends this pump then owns); False once closed."""
        x, y = _End(a), _End(b)
        x.peer, y.peer = y, x
        with self._lock:
            if self._closed:
                return False
            a.setblocking(False)
            b.setblocking(False)
            self._new.append((x, y))
        self._wake()
        return True

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (already woken) or closed
            pass

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, events in self._sel.select(timeout=1.0):
                    if key.data is None:
                        self._take_new()
                    elif key.data in self._ends:
                        self._step(key.data, events)
        finally:
            for end in list(self._ends):
                self._drop(end)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _take_new(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            new, self._new = self._new, []
        for x, y in new:
            self._ends.update((x, y))
            self._watch(x)
            self._watch(y)

    def _step(self, end: _End, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = end.sock.recv(_BUFFER - len(end.peer.out))
                if data:
                    end.peer.out += data
                else:
                    end.eof = True
            if events & selectors.EVENT_WRITE and end.out:
                del end.out[:end.sock.send(end.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return self._drop(end)
        # One side gone and what it sent delivered: the pair is done (gRPC does not half-close).
        if (end.eof and not end.peer.out) or (end.peer.eof and not end.out):
            return self._drop(end)
        self._watch(end)
        self._watch(end.peer)

    def _watch(self, end: _End) -> None:
        events = 0
        if not end.eof and len(end.peer.out) < _BUFFER:
            events |= selectors.EVENT_READ
        if end.out:
            events |= selectors.EVENT_WRITE
        if events == end.events:
            return
        if end.events and events:
            self._sel.modify(end.sock, events, end)
        elif events:
            self._sel.register(end.sock, events, end)
        else:
            self._sel.unregister(end.sock)
        end.events = events

    def _drop(self, end: _End) -> None:
        for e in (end, end.peer):
            if e in self._ends:
                self._ends.discard(e)
                if e.events:
                    self._sel.unregister(e.sock)
                    e.events = 0
                e.sock.close()

