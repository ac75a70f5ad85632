"""The launcher's end of the control plane: a gRPC server on 127.0.0.1 for the job's agents.

Agents reach it through a remote port forward of their SSH connection (or directly with --local), so
it never listens on a public interface. A server interceptor rejects every call that does not carry
the job's random token (UNAUTHENTICATED). The server runs on its own asyncio thread and turns what
agents send into typed events on a thread-safe queue that the supervisor drains:

    Registered(worker, request)      an agent started and reported its versions (worker 0: free ports)
    SessionOpened(worker)            its Session stream is open: it can take a Start
    AgentReport(worker, message)     Started / Exited / Logs / Heartbeat
    SessionLost(worker, reason)      its Session stream ended

    server = ControlServer(token, events)
    port = server.start()
    server.send(worker, pb.LauncherMessage(stop=pb.Stop(grace_s=3)))
    server.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import threading
from typing import TYPE_CHECKING

import grpc

from tpudist.launch.control import MESSAGE_SIZE_OPTIONS, TOKEN_METADATA
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.control import control_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tpudist.launch._wake import WakeQueue


@dataclasses.dataclass(frozen=True)
class Registered:
    """An agent called Register: it runs, and reports its versions (worker 0 also free ports)."""

    worker: int
    request: pb.RegisterRequest


@dataclasses.dataclass(frozen=True)
class SessionOpened:
    """An agent's Session stream is open: it can take a Start."""

    worker: int


@dataclasses.dataclass(frozen=True)
class AgentReport:
    """A message on an agent's Session stream: Started, Exited, Logs or Heartbeat."""

    worker: int
    message: pb.AgentMessage


@dataclasses.dataclass(frozen=True)
class SessionLost:
    """An agent's Session stream ended (the agent exited, or its connection broke)."""

    worker: int
    reason: str


ControlEvent = Registered | SessionOpened | AgentReport | SessionLost

_REJECTED = "missing or wrong job token (metadata 'tpudist-token'); only this job's agents may call"


async def _deny_unary(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REJECTED)


async def _deny_stream(request_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REJECTED)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only if its metadata carries the job token."""

    def __init__(self, token: str, on_reject=None) -> None:
        self._token = token.encode()
        self._on_reject = on_reject

    async def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._token):
            return await continuation(details)
        if self._on_reject:
            self._on_reject(details.method)
        handler = await continuation(details)  # the same kind of handler, so the client reads a status
        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny_stream)
        return grpc.unary_unary_rpc_method_handler(_deny_unary)


class _Servicer(pb_grpc.ControlServicer):
    def __init__(self, server: "ControlServer") -> None:
        self.server = server

    async def Register(self, request, context):
        self.server.events.put(Registered(request.worker, request))
        return pb.RegisterReply(job_id=self.server.job_id)

    async def Session(self, request_iterator, context):
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        worker = first.worker
        outbox: asyncio.Queue = asyncio.Queue()
        self.server.outboxes[worker] = outbox
        events = self.server.events
        events.put(SessionOpened(worker))

        async def read() -> None:
            reason = "the agent closed its control stream"
            try:
                while (msg := await context.read()) is not grpc.aio.EOF:
                    if msg.WhichOneof("kind") == "goodbye":  # it ends by itself, and says why
                        reason = f"the agent ended: {msg.goodbye.reason}"
                        continue
                    events.put(AgentReport(worker, msg))
            except (grpc.RpcError, asyncio.CancelledError) as e:
                reason = f"control stream broken ({getattr(e, 'code', lambda: 'cancelled')()})"
            finally:
                events.put(SessionLost(worker, reason))
                outbox.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (msg := await outbox.get()) is not None:
                await context.write(msg)
        finally:
            reader.cancel()
            if self.server.outboxes.get(worker) is outbox:
                del self.server.outboxes[worker]


class ControlServer:
    """The gRPC server, on 127.0.0.1 (or, over TLS, on every interface) and an asyncio thread of its own."""

    def __init__(self, token: str, events: "WakeQueue[ControlEvent]", job_id: str = "") -> None:
        self.token, self.events, self.job_id = token, events, job_id
        self.outboxes: dict[int, asyncio.Queue] = {}
        self.rejected = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tpudist-control", daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self, timeout_s: float = 10.0, *, bind: str = "127.0.0.1",
              tls: tuple[bytes, bytes] | None = None) -> int:
        """Starts serving; returns the port on `bind` (127.0.0.1: agents come through SSH tunnels;
        with `tls`, a (key, certificate) pair, agents dial it over the network)."""
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(bind, tls), self._loop).result(timeout_s)

    async def _start(self, bind: str, tls: tuple[bytes, bytes] | None) -> int:
        self._server = grpc.aio.server(
            interceptors=[TokenInterceptor(self.token, self._count_reject)],
            options=[("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 5000),
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                     ("grpc.http2.max_ping_strikes", 0), *MESSAGE_SIZE_OPTIONS])
        pb_grpc.add_ControlServicer_to_server(_Servicer(self), self._server)
        if tls is None:
            port = self._server.add_insecure_port(f"{bind}:0")
        else:
            port = self._server.add_secure_port(f"{bind}:0", grpc.ssl_server_credentials([tls]))
        await self._server.start()
        return port

    def _count_reject(self, method: str) -> None:
        self.rejected += 1

    def send(self, worker: int, msg: pb.LauncherMessage) -> bool:
        """Queues `msg` for `worker`'s agent; False when it has no open session."""
        outbox = self.outboxes.get(worker)
        if outbox is None:
            return False
        self._loop.call_soon_threadsafe(outbox.put_nowait, msg)
        return True

    def close(self, grace_s: float = 1.0) -> None:
        if not self._thread.is_alive():
            return
        if self._server is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(grace_s + 2)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
