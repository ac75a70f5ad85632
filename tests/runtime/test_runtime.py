"""The runtime: init() from the environment contract, and torch.distributed alongside it."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import tpudist
from tpudist import contract
from tpudist.testing import run_on_mesh


def test_contract_round_trips_and_rejects_bad_values():
    env = contract.JobEnv(rank=1, world_size=4, local_rank=1, local_world_size=2,
                          coordinator="10.0.0.2:8476", master_addr="10.0.0.2", master_port=29500,
                          cpu_devices=2, job_id="abc")
    assert contract.JobEnv.from_environ(env.to_environ()) == env
    assert env.to_environ()["RANK"] == "1" and env.to_environ()["TPUDIST_COORDINATOR"] == "10.0.0.2:8476"
    with pytest.raises(ValueError, match="RANK='x' must be an integer"):
        contract.JobEnv.from_environ({"RANK": "x"})
    with pytest.raises(ValueError, match=r"RANK=4 must be in \[0, WORLD_SIZE=4\)"):
        contract.JobEnv.from_environ({"RANK": "4", "WORLD_SIZE": "4", "TPUDIST_COORDINATOR": "h:1"})
    with pytest.raises(ValueError, match="TPUDIST_COORDINATOR is not set"):
        contract.JobEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="TPUDIST_COLLECTIVE_TIMEOUT='-1' must be a positive"):
        contract.JobEnv.from_environ({"TPUDIST_COLLECTIVE_TIMEOUT": "-1"})


_SINGLE = """
import numpy as np, tpudist, jax
job = tpudist.init()
assert tpudist.init() is job                      # idempotent
assert (tpudist.process_index(), tpudist.process_count()) == (0, 1)
assert len(tpudist.local_devices()) == 3 == len(tpudist.devices())
out = tpudist.all_reduce([np.arange(3.0), 2])      # a one-process job still runs collectives
assert out[0].tolist() == [0.0, 1.0, 2.0] and out[1] == 2
tpudist.barrier()
print("ok")
"""


def test_single_process_job_with_nothing_set():
    env = {k: v for k, v in os.environ.items() if k not in contract.ALL}
    env[contract.CPU_DEVICES] = "3"
    out = subprocess.run([sys.executable, "-c", _SINGLE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


_REJOIN = """
import numpy as np, tpudist
x = np.arange(6, dtype=np.float32).reshape(2, 3)
first = tpudist.init({"TPUDIST_JOB_ID": "first"})
np.testing.assert_array_equal(tpudist.all_reduce(x, scale=0.5), x * 0.5)
np.testing.assert_array_equal(tpudist.all_gather(x), x)
stats = tpudist.collective_stats()
assert (stats.compiles, stats.calls) == (2, 2), stats
tpudist.shutdown()
assert not tpudist.is_initialized()
second = tpudist.init({"TPUDIST_JOB_ID": "second", "TPUDIST_COLLECTIVE_TIMEOUT": "7"})
assert second is not first and second.job_id == "second"
# A fresh engine for the new job: it compiles again and counts from zero.
np.testing.assert_array_equal(tpudist.all_reduce(x * 3, scale=0.5), x * 1.5)
y, two = tpudist.all_reduce([x, 2], op="max")
np.testing.assert_array_equal(y, x)
assert two == 2 and type(two) is int
stats = tpudist.collective_stats()
assert (stats.compiles, stats.calls) == (2, 2), stats
tpudist.barrier()
print("ok")
"""


def test_shutdown_then_init_runs_collectives_on_a_fresh_engine():
    env = {k: v for k, v in os.environ.items() if k not in contract.ALL}
    out = subprocess.run([sys.executable, "-c", _REJOIN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def torch_alongside() -> tuple[float, float]:
    import torch.distributed as dist
    assert os.environ["MASTER_PORT"] != os.environ["TPUDIST_COORDINATOR"].rsplit(":", 1)[1]
    dist.init_process_group("gloo", init_method="env://")
    try:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        mine = tpudist.all_reduce(torch.tensor([float(tpudist.process_index() + 1)]))
        return float(t), float(mine)
    finally:
        dist.destroy_process_group()


def test_torch_distributed_env_init_works_inside_a_job():
    assert run_on_mesh(torch_alongside, nprocs=2) == [(3.0, 3.0), (3.0, 3.0)]


@pytest.mark.tpudist(nprocs=2, cpu_devices=2)
def test_the_pytest_marker_runs_on_every_rank():
    assert tpudist.process_count() == 2 and len(tpudist.devices()) == 4
    assert tpudist.all_gather(torch.tensor([tpudist.process_index()])).tolist() == [0, 1]


def rank_one_fails() -> None:
    assert tpudist.process_index() != 1, "rank one is wrong"


def test_run_on_mesh_reports_the_failing_rank_assertion():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed:.*AssertionError: rank one is wrong"):
        run_on_mesh(rank_one_fails, nprocs=2)


def coordinator_listeners() -> list[str]:
    """The local addresses listening on this job's coordinator port (from /proc/net/tcp*)."""
    port = int(os.environ["TPUDIST_COORDINATOR"].rsplit(":", 1)[1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(addr)
                    # the kernel prints each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    ip = ipaddress.ip_address(raw)
                    found.append(str(getattr(ip, "ipv4_mapped", None) or ip))  # gRPC: ::ffff:127.0.0.1
    tpudist.barrier()
    return found


def test_rank_0_serves_the_coordinator_on_the_job_address_not_every_interface():
    # tpudist.spawn advertises 127.0.0.1; JAX's default would listen on [::] (every interface).
    listeners = run_on_mesh(coordinator_listeners, nprocs=2)[0]
    assert listeners == ["127.0.0.1"], listeners


_RANK0 = "import tpudist; tpudist.init()"


@pytest.mark.parametrize("reuseport", [False, True], ids=["a-program", "another-coordinator"])
def test_a_taken_coordinator_port_is_named_at_init_not_reported_as_a_timeout(reuseport):
    # JAX's gRPC server binds with SO_REUSEPORT: a second coordinator would share another job's port.
    with socket.socket() as held:
        if reuseport:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if k not in contract.ALL}, "RANK": "0", "WORLD_SIZE": "2",
               "TPUDIST_COORDINATOR": f"127.0.0.1:{port}", "TPUDIST_INIT_TIMEOUT": "10", "TPUDIST_CPU_DEVICES": "1"}
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _RANK0], env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    assert out.returncode == 1
    assert f"rank 0 on 127.0.0.1: the JAX coordinator's port {port} is already in use on 127.0.0.1" in out.stderr, \
        out.stderr[-2000:]
    assert "--coordinator-port" in out.stderr and took < 10, took


def test_the_coordinator_binds_where_the_other_hosts_reach_it(caplog):
    from tpudist import _coordinator

    def job(coordinator: str, num_workers: int = 2) -> contract.JobEnv:
        return contract.JobEnv(rank=0, world_size=2, local_rank=0, local_world_size=1, coordinator=coordinator,
                               num_workers=num_workers)

    assert _coordinator.bind_address(job("127.0.0.1:1234"), {}) == "127.0.0.1:1234"
    assert _coordinator.bind_address(job("unix:/tmp/x.sock"), {}) == "unix:/tmp/x.sock"
    assert _coordinator.bind_address(job("127.0.0.1:1234"), {"JAX_COORDINATOR_BIND_ADDRESS": "[::]:99"}) == "[::]:99"
    # A name that resolves to loopback here is something else to the other hosts: every interface.
    assert _coordinator.bind_address(job("localhost:1234"), {}) == "[::]:1234"
    assert _coordinator.bind_address(job("localhost:1234", num_workers=1), {}) == "localhost:1234"
    # An address that is not this host's (a NAT address given in --hosts): every interface, said so.
    with caplog.at_level("WARNING", logger="tpudist"):
        assert _coordinator.bind_address(job("192.0.2.1:1234"), {}) == "[::]:1234"
    assert "192.0.2.1 is not an address of this host" in caplog.text
