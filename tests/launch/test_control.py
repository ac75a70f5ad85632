"""The control plane's gRPC server: only calls carrying the job token get through."""

from __future__ import annotations

import queue

import grpc
import pytest

from tpudist.launch.control import TOKEN_METADATA
from tpudist.launch.control import control_pb2 as pb
from tpudist.launch.control import control_pb2_grpc as pb_grpc
from tpudist.launch.control._server import AgentReport, ControlServer, Registered, SessionLost, SessionOpened


@pytest.fixture
def server():
    events: queue.Queue = queue.Queue()
    srv = ControlServer("the-job-token", events, job_id="job1")
    port = srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield srv, events, pb_grpc.ControlStub(channel), port
    channel.close()
    srv.close()


@pytest.mark.parametrize("metadata", [None, ((TOKEN_METADATA, "wrong"),), (("other", "the-job-token"),)])
def test_calls_without_the_token_are_rejected(server, metadata):
    srv, events, stub, _ = server
    with pytest.raises(grpc.RpcError) as e:
        stub.Register(pb.RegisterRequest(worker=0, host="h"), metadata=metadata, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Session(iter([pb.AgentMessage(worker=0, hello=pb.Hello())]), metadata=metadata, timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert events.empty()  # nothing of a rejected call reaches the supervisor
    assert srv.rejected == 2


def test_a_call_with_the_token_registers_and_gets_commands(server):
    srv, events, stub, _ = server
    reply = stub.Register(pb.RegisterRequest(worker=3, host="h", versions={"jax": "1"}),
                          metadata=((TOKEN_METADATA, "the-job-token"),), timeout=10)
    assert reply.job_id == "job1"
    event = events.get(timeout=5)
    assert isinstance(event, Registered) and (event.worker, event.request.versions["jax"]) == (3, "1")

    outgoing: queue.Queue = queue.Queue()
    outgoing.put(pb.AgentMessage(worker=3, hello=pb.Hello()))

    def requests():
        while (msg := outgoing.get(timeout=10)) is not None:
            yield msg

    responses = stub.Session(requests(), metadata=((TOKEN_METADATA, "the-job-token"),), timeout=20)
    assert events.get(timeout=5) == SessionOpened(3)
    assert srv.send(3, pb.LauncherMessage(stop=pb.Stop(grace_s=1.5)))
    assert next(responses).stop.grace_s == 1.5
    outgoing.put(pb.AgentMessage(worker=3, exited=pb.Exited(rank=5, exit_code=7)))
    event = events.get(timeout=5)
    assert isinstance(event, AgentReport)
    assert (event.worker, event.message.exited.rank, event.message.exited.exit_code) == (3, 5, 7)
    outgoing.put(None)  # the agent closes its stream: the supervisor hears that it is gone
    event = events.get(timeout=5)
    assert isinstance(event, SessionLost) and event.worker == 3


def _listening(port: int) -> list[str]:
    """Local addresses listening on `port`, read from the kernel's socket tables."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_the_server_listens_on_loopback_only(server):
    _, _, _, port = server
    addresses = _listening(port)
    # 127.0.0.1, as an IPv4 socket or IPv4-mapped on an IPv6 one; never a wildcard or a public address.
    assert addresses and set(addresses) <= {"0100007F", "0000000000000000FFFF00000100007F"}, addresses
