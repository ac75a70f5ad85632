"""The launcher gives TorchTPU programs on a TPU slice what they expect (issue 29, item 7).

TorchTPU (`torch_tpu`) is not installable here, and a slice is not reachable: its multi-host wrapper
is stood in by `standin_torchtpu_multihost_wrapper` below, written from the behaviour its own test
states (torch_tpu/_internal/distributed/launchers/multihost_wrapper_test.py: from TPU_WORKER_HOSTNAMES
and JOB_COMPLETION_INDEX it derives TORCH_TPU_SLICEBUILDER_ADDRESSES = every host's ports base..base+D-1
with base TORCH_TPU_BASE_PORT (8070) and D TORCH_TPU_DEVICES_PER_HOST (8), NNODES, NODE_RANK,
MASTER_ADDR = the first host, MASTER_PORT = 29500, keeping a MASTER_* already set). The slice's
hosts come from the gcloud stand-in (tests/launch/gcloud_standin.py). The launcher's plan must be
a fixed point of the wrapper, with values that match the slice.
"""

from __future__ import annotations

import copy
import json
import socket

import pytest
from gcloud_standin import V4_32_NODE, install
from launchutil import launch

from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.tpu.env import tpu_process_env

TORCHTPU_NAMES = ("TPU_WORKER_HOSTNAMES", "JOB_COMPLETION_INDEX", "NNODES", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY")


def standin_torchtpu_multihost_wrapper(environ: dict[str, str]) -> dict[str, str]:
    """What TorchTPU's multihost_wrapper.prepare_tpu_environment() leaves in `environ` (stand-in)."""
    if not environ.get("TPU_WORKER_HOSTNAMES"):
        raise ValueError("No TPU_WORKER_HOSTNAMES found.")
    if "JOB_COMPLETION_INDEX" not in environ:
        raise ValueError("No JOB_COMPLETION_INDEX found in environment.")
    hosts = environ["TPU_WORKER_HOSTNAMES"].split(",")
    base = int(environ.get("TORCH_TPU_BASE_PORT", "8070"))
    devices = int(environ.get("TORCH_TPU_DEVICES_PER_HOST", "8"))
    return {**environ, "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"{h}:{base + d}" for h in hosts
                                                                     for d in range(devices)),
            "NNODES": str(len(hosts)), "NODE_RANK": environ["JOB_COMPLETION_INDEX"],
            "MASTER_ADDR": environ.get("MASTER_ADDR", hosts[0]), "MASTER_PORT": environ.get("MASTER_PORT", "29500")}


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    stand_in = install(tmp_path, monkeypatch)
    stand_in.behaviour["config"] = {"compute/zone": "us-central2-b", "project": "my-proj"}
    node = copy.deepcopy(V4_32_NODE)  # a v4-16: 2 workers of 4 chips, endpoints out of IP order
    node.update(name="projects/my-proj/locations/us-central2-b/nodes/pair", acceleratorType="v4-16",
                acceleratorConfig={"type": "V4", "topology": "2x2x2"})
    node["networkEndpoints"] = node["networkEndpoints"][:2]
    stand_in.behaviour["node"] = node
    stand_in.write()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # no metadata server here
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed.getsockname()[1]}")
    yield stand_in
    closed.close()


def _plan(*flags: str) -> list[dict]:
    r = launch(*flags, "--dry-run", "--", "python", "train.py", timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)["processes"]


def test_dry_run_on_a_2_host_slice_sets_what_torchtpus_multihost_wrapper_reads_and_derives(gcloud):
    procs = _plan("--tpu=pair")
    assert [(p["worker"], p["rank"]) for p in procs] == [(0, 0), (1, 1)]
    hosts = "10.130.0.9,10.130.0.3"  # the slice's internal IPs in worker order
    for p in procs:
        env, w = p["env"], str(p["worker"])
        assert (env["TPU_WORKER_HOSTNAMES"], env["JOB_COMPLETION_INDEX"], env["TPU_WORKER_ID"]) == (hosts, w, w)
        assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("2", w, "10.130.0.9")
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2"  # v4-16: 2x2x2 chips
        assert env["TORCH_TPU_DEVICES_PER_HOST"] == "4"
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") == [
            f"{ip}:{8070 + d}" for ip in hosts.split(",") for d in range(4)]
        wrapped = standin_torchtpu_multihost_wrapper(env)
        assert {n: wrapped[n] for n in TORCHTPU_NAMES} == {n: env[n] for n in TORCHTPU_NAMES}


def test_dry_run_of_a_2_host_hosts_job_sets_torchruns_host_count_and_index_only():
    procs = _plan("--hosts", "127.0.0.2,127.0.0.3", "--nproc-per-host", "2")
    assert [(p["env"]["NNODES"], p["env"]["NODE_RANK"]) for p in procs] == [
        ("2", "0"), ("2", "0"), ("2", "1"), ("2", "1")]
    assert not any(k.startswith("TORCH_TPU_") or k == "JOB_COMPLETION_INDEX" for p in procs for k in p["env"])
    r = launch("--hosts", "127.0.0.2,127.0.0.3", "--env", "NODE_RANK=0", "--dry-run", "--", "true", timeout=60)
    assert r.returncode == 2 and b"NODE_RANK is set by the launcher for each process" in r.stderr


def test_one_process_per_chip_finds_its_own_slice_builder_address_at_its_rank():
    ips = ["10.0.0.9", "10.0.0.3"]
    cluster = Cluster(source="test", hosts=tuple(Host(f"h{i}", internal_ip=ip) for i, ip in enumerate(ips)),
                      accelerator_type="v4-16")
    for worker in range(2):
        for local_rank in range(4):
            env = tpu_process_env(cluster, worker, local_rank, 4)
            rank = worker * 4 + local_rank
            assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[rank] == f"{ips[worker]}:{8070 + local_rank}"


def test_tpu7x_counts_two_devices_per_chip_as_a_fourth_axis():
    cluster = Cluster(source="test", hosts=tuple(Host(f"h{i}", internal_ip=f"10.0.0.{i}") for i in range(4)),
                      accelerator_type="tpu7x-32")  # 16 chips, 2x2x4, 4 workers of 4 chips
    env = tpu_process_env(cluster, 3, 0, None)
    assert (env["TORCH_TPU_TOPOLOGY"], env["TORCH_TPU_DEVICES_PER_HOST"]) == ("2,2,4,2", "8")
    assert len(env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 32
    wrapped = standin_torchtpu_multihost_wrapper(env)
    assert wrapped["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == env["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert (wrapped["NNODES"], wrapped["NODE_RANK"]) == ("4", "3")
