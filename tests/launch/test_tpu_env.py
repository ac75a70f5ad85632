"""The TPU environment per worker and per process, checked against torch_xla's published cases.

The per-chip expectations are torch_xla's own test (test/pjrt/test_experimental_tpu.py,
`test_configure_tpu_topology`): v4-16, 4 processes per worker, worker IPs 10.130.0.31 then
10.130.0.30 (not sorted), worker 1 local rank 0 -> task 4, port 8476, visible chip 0, process
bounds 2,2,2, and the full TPU_PROCESS_ADDRESSES string below.
"""

from __future__ import annotations

import pytest

from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.tpu.env import (coordinator_address, check_nproc_per_host,
                                    default_nproc_per_host, tpu_process_env, worker_env)


def _cluster(accelerator_type, ips, tpu_env=None, topology=None, external=None):
    hosts = tuple(Host(address=(external or ips)[i], internal_ip=ip) for i, ip in enumerate(ips))
    return Cluster(source="test", hosts=hosts, accelerator_type=accelerator_type,
                   tpu_env=tpu_env or {}, topology=topology)


V4_16_IPS = ["10.130.0.31", "10.130.0.30"]
TORCH_XLA_V4_16_ADDRESSES = (
    "10.130.0.31:8476,10.130.0.31:8477,10.130.0.31:8478,10.130.0.31:8479,"
    "10.130.0.30:8476,10.130.0.30:8477,10.130.0.30:8478,10.130.0.30:8479")


@pytest.mark.parametrize("tpu_env", [
    None,  # from the table alone (as the gcloud source resolves it)
    {"ACCELERATOR_TYPE": "v4-16", "CHIPS_PER_HOST_BOUNDS": "2,2,1", "HOST_BOUNDS": "1,1,2"},
], ids=["table", "tpu-env"])
def test_torch_xla_v4_16_worker_1_local_rank_0(tpu_env):
    env = tpu_process_env(_cluster("v4-16", V4_16_IPS, tpu_env), worker=1, local_rank=0,
                          nproc_per_host=4)
    assert env["CLOUD_TPU_TASK_ID"] == "4"
    assert env["TPU_PROCESS_PORT"] == "8476"
    assert env["TPU_VISIBLE_CHIPS"] == "0"
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,2"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_ADDRESSES"] == TORCH_XLA_V4_16_ADDRESSES
    assert env["TPU_WORKER_ID"] == "1"
    assert env["TPU_WORKER_HOSTNAMES"] == "10.130.0.31,10.130.0.30"  # worker order, unsorted
    assert env["PJRT_DEVICE"] == "TPU"


def test_torch_xla_v4_8_process_3():
    # torch_xla's v4-8 case: one worker, local rank 3 of 4 -> task 3, port 8479, chip 3, 2,2,1.
    env = tpu_process_env(_cluster("v4-8", ["10.0.0.2"]), worker=0, local_rank=3,
                          nproc_per_host=4)
    assert (env["CLOUD_TPU_TASK_ID"], env["TPU_PROCESS_PORT"], env["TPU_VISIBLE_CHIPS"],
            env["TPU_PROCESS_BOUNDS"]) == ("3", "8479", "3", "2,2,1")
    assert env["TPU_PROCESS_ADDRESSES"] == ",".join(f"10.0.0.2:{p}" for p in range(8476, 8480))


def test_every_process_of_a_per_chip_slice_gets_a_distinct_task_and_chip():
    cluster = _cluster("v4-32", ["10.0.0.9", "10.0.0.3", "10.0.0.7", "10.0.0.5"])
    seen = set()
    for worker in range(4):
        for rank in range(4):
            env = tpu_process_env(cluster, worker, rank, 4)
            seen.add(int(env["CLOUD_TPU_TASK_ID"]))
            assert env["TPU_VISIBLE_CHIPS"] == str(rank)
            assert env["TPU_PROCESS_BOUNDS"] == "2,2,4"  # host bounds 1,1,4 x chips 2,2,1
            # This process's own address is at index task id in the address list.
            own = env["TPU_PROCESS_ADDRESSES"].split(",")[int(env["CLOUD_TPU_TASK_ID"])]
            assert own == f"{cluster.hosts[worker].internal_ip}:{env['TPU_PROCESS_PORT']}"
    assert seen == set(range(16))


def test_one_process_per_worker_gets_the_worker_variables_only():
    cluster = _cluster("v4-32", ["10.0.0.9", "10.0.0.3", "10.0.0.7", "10.0.0.5"])
    env = tpu_process_env(cluster, worker=2, local_rank=0, nproc_per_host=None)
    assert env == {
        "TPU_WORKER_ID": "2",
        "TPU_WORKER_HOSTNAMES": "10.0.0.9,10.0.0.3,10.0.0.7,10.0.0.5",
        "TPU_ACCELERATOR_TYPE": "v4-32",
        "TPU_TOPOLOGY": "2x2x4",
        "TPU_HOST_BOUNDS": "1,1,4",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "PJRT_DEVICE": "TPU",
        # TorchTPU's (see test_torch_tpu_env.py): the worker as JobSet's index, the chip grid, and
        # every worker's slice-builder address per chip.
        "JOB_COMPLETION_INDEX": "2",
        "TORCH_TPU_TOPOLOGY": "2,2,4",
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(
            f"{ip}:{8070 + d}" for ip in ("10.0.0.9", "10.0.0.3", "10.0.0.7", "10.0.0.5") for d in range(4)),
        "TORCH_TPU_BASE_PORT": "8070",
        "TORCH_TPU_DEVICES_PER_HOST": "4",
    }
    assert tpu_process_env(cluster, 2, 0, 1) == env == worker_env(cluster, 2)
    assert default_nproc_per_host(cluster) == 1


def test_peers_use_internal_ips_even_when_the_launcher_connects_to_external_ones():
    cluster = _cluster("v4-16", V4_16_IPS, external=["34.1.1.1", "34.1.1.2"])
    env = tpu_process_env(cluster, 0, 0, None)
    assert env["TPU_WORKER_HOSTNAMES"] == "10.130.0.31,10.130.0.30"
    assert coordinator_address(cluster) == "10.130.0.31:8482"  # JAX's port on Cloud TPU


def test_v5litepod_8_per_chip_uses_eight_ports_and_the_coordinator_avoids_them():
    cluster = _cluster("v5litepod-8", ["10.0.0.2"])
    env = tpu_process_env(cluster, 0, 7, 8)
    assert env["TPU_PROCESS_BOUNDS"] == "2,4,1"
    assert env["TPU_PROCESS_PORT"] == "8483"
    ports = {int(a.rsplit(":", 1)[1]) for a in env["TPU_PROCESS_ADDRESSES"].split(",")}
    assert ports == set(range(8476, 8484))
    coordinator_port = int(coordinator_address(cluster, nproc_per_host=8).rsplit(":", 1)[1])
    assert coordinator_port not in ports


def test_tpu_env_values_win_over_the_table():
    # A v4-64 built as 4x4x2 instead of the default 2x4x4: the metadata says so.
    tpu_env = {"ACCELERATOR_TYPE": "v4-64", "TOPOLOGY": "4x4x2", "HOST_BOUNDS": "2,2,2",
               "CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    cluster = _cluster("v4-64", [f"10.0.0.{i}" for i in range(8)], tpu_env)
    env = tpu_process_env(cluster, 0, 0, None)
    assert env["TPU_HOST_BOUNDS"] == "2,2,2" and env["TPU_TOPOLOGY"] == "4x4x2"
    assert tpu_process_env(cluster, 0, 0, 4)["TPU_PROCESS_BOUNDS"] == "4,4,2"


def test_tpu_env_launches_a_generation_the_table_does_not_know():
    tpu_env = {"ACCELERATOR_TYPE": "v9-16", "HOST_BOUNDS": "1,1,2",
               "CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    env = tpu_process_env(_cluster(None, ["10.0.0.1", "10.0.0.2"], tpu_env), 1, 0, None)
    assert (env["TPU_ACCELERATOR_TYPE"], env["TPU_HOST_BOUNDS"]) == ("v9-16", "1,1,2")


def test_a_process_count_that_splits_a_worker_unevenly_is_refused():
    cluster = _cluster("v4-16", V4_16_IPS)
    assert check_nproc_per_host(cluster, 4) == 4 and check_nproc_per_host(cluster, None) == 1
    with pytest.raises(ValueError, match=r"--nproc-per-host 2 .* 4 chips, so run 1 .* or 4"):
        tpu_process_env(cluster, 0, 0, 2)


def test_a_cluster_with_missing_workers_is_refused():
    with pytest.raises(ValueError, match=r"has 4 workers, but the 'test' source found 3 hosts"):
        tpu_process_env(_cluster("v4-32", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]), 0, 0, None)


def test_a_cluster_without_an_accelerator_type_is_refused():
    with pytest.raises(ValueError, match="no TPU accelerator type"):
        tpu_process_env(_cluster(None, ["10.0.0.1"]), 0, 0, None)


def test_worker_and_local_rank_out_of_range_are_refused():
    cluster = _cluster("v4-16", V4_16_IPS)
    with pytest.raises(ValueError, match=r"worker 2 is not in \[0, 2\)"):
        tpu_process_env(cluster, 2, 0, None)
    with pytest.raises(ValueError, match=r"local rank 4 is not in \[0, 4\)"):
        tpu_process_env(cluster, 0, 4, 4)
