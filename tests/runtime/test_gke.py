"""`tpudist.init()` with no launcher joins a TPU slice GKE / JobSet started (issue 29, item 7).

GKE and JobSet cannot run here: their pods' variables are stood in by environments written by the
test (STANDIN_* below, named as such), the values GKE's TPU webhook and xpk's JobSet manifests give
(TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, JOB_COMPLETION_INDEX, MEGASCALE_*). The processes are real: two
Python processes started by the test, not by the launcher, each `tpudist.init()` and `all_reduce`
over real XLA:CPU (gloo). On one machine the workers are loopback addresses 127.0.0.1 and 127.0.0.2;
worker 0's, 127.0.0.1, is where rank 0 serves the coordinator, on a free port given by
TPUDIST_COORDINATOR_PORT (a real slice uses the default, 8482).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tpudist import _jobsource, contract
from tpudist._gke import GkeSource

# What GKE gives the pods of a 2-worker TPU slice (worker 1's view).
STANDIN_GKE_WORKER_1 = {"TPU_WORKER_HOSTNAMES": "w-0.slice.svc,w-1.slice.svc", "TPU_WORKER_ID": "1"}
# What xpk's JobSet gives worker 0 of slice 1 in a job of 2 slices of 2 workers (v7x-style address:port).
STANDIN_JOBSET_SLICE_1 = {"TPU_WORKER_HOSTNAMES": "b-0.svc,b-1.svc", "JOB_COMPLETION_INDEX": "0",
                          "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
                          "MEGASCALE_COORDINATOR_ADDRESS": "a-0.svc:8081"}


def test_gke_worker_variables_give_rank_world_size_and_coordinator():
    job = _jobsource.detect(STANDIN_GKE_WORKER_1)
    assert (job.rank, job.world_size, job.worker, job.num_workers) == (1, 2, 1, 2)
    assert job.coordinator == "w-0.slice.svc:8482"  # worker 0, JAX's Cloud TPU port
    assert (job.master_addr, job.host, job.local_rank, job.local_world_size) == ("w-0.slice.svc", "w-1.slice.svc", 0, 1)


def test_jobset_multislice_ranks_are_slice_major_with_slice_0_worker_0_as_coordinator():
    job = _jobsource.detect({**STANDIN_JOBSET_SLICE_1, "TPUDIST_COORDINATOR_PORT": "9000"})
    assert (job.rank, job.world_size, job.num_slices, job.slice_id) == (2, 4, 2, 1)
    assert job.coordinator == "a-0.svc:9000"  # the port in MEGASCALE_COORDINATOR_ADDRESS is libtpu's, dropped
    assert job.slice_of(job.rank) == 1


def test_the_launchers_contract_wins_and_nothing_set_is_one_process():
    launched = {**STANDIN_GKE_WORKER_1, "RANK": "3", "WORLD_SIZE": "4", "TPUDIST_COORDINATOR": "10.0.0.2:1234"}
    job = _jobsource.detect(launched)
    assert (job.rank, job.world_size, job.coordinator) == (3, 4, "10.0.0.2:1234")
    assert dict(_jobsource.verdicts(launched))["launcher"].applies
    job = _jobsource.detect({})
    assert (job.rank, job.world_size, job.coordinator) == (0, 1, None)
    assert "neither TPU_PROCESS_ADDRESSES nor TPU_WORKER_HOSTNAMES" in dict(_jobsource.verdicts({}))["gke"].reason


@pytest.mark.parametrize("environ, message", [
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "neither TPU_WORKER_ID nor JOB_COMPLETION_INDEX says which one"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"}, r"TPU_WORKER_ID=2 but TPU_WORKER_HOSTNAMES lists 2"),
    ({"TPU_WORKER_HOSTNAMES": "a,,b", "TPU_WORKER_ID": "0"}, "has an empty entry"),
    ({**STANDIN_JOBSET_SLICE_1, "MEGASCALE_SLICE_ID": ""}, "MEGASCALE_NUM_SLICES=2 but MEGASCALE_SLICE_ID is not set"),
    ({**STANDIN_JOBSET_SLICE_1, "MEGASCALE_COORDINATOR_ADDRESS": ""}, "only it names slice 0's worker 0"),
    ({**STANDIN_GKE_WORKER_1, "TPUDIST_COORDINATOR_PORT": "70000"}, r"TPUDIST_COORDINATOR_PORT=70000 is not a TCP port"),
])
def test_an_inconsistent_gke_environment_is_an_error_naming_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        GkeSource.job(environ)


_TRAIN = """
import numpy as np, tpudist
job = tpudist.init()
total = tpudist.all_reduce(np.array([job.rank + 1.0]))
print("JOINED", job.rank, job.world_size, tpudist.process_count(), job.slice_id, float(total[0]), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pods(pod_envs: list[dict[str, str]]) -> list[str]:
    """Starts one real process per stand-in pod environment; returns each one's JOINED line."""
    base = {k: v for k, v in os.environ.items()
            if k not in contract.ALL and not k.startswith(("TPU_", "MEGASCALE_", "OMPI_", "JAX_"))
            and k != "JOB_COMPLETION_INDEX"}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _TRAIN], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**base, "JAX_PLATFORMS": "cpu", "TPUDIST_COORDINATOR_PORT": port,
                                   "TPUDIST_INIT_TIMEOUT": "60", "TPUDIST_COLLECTIVE_TIMEOUT": "60", **pod})
             for pod in pod_envs]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [next((ln for ln in out.splitlines() if ln.startswith("JOINED")), out) for out, _ in outputs]


def test_two_pods_of_a_standin_gke_slice_join_one_job_and_all_reduce():
    pods = [{"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.2", "TPU_WORKER_ID": str(w)} for w in (0, 1)]
    assert _run_pods(pods) == ["JOINED 0 2 2 None 3.0", "JOINED 1 2 2 None 3.0"]


def test_two_standin_jobset_slices_of_one_worker_join_one_multislice_job():
    pods = [{"TPU_WORKER_HOSTNAMES": f"127.0.0.{s + 1}", "JOB_COMPLETION_INDEX": "0", "MEGASCALE_NUM_SLICES": "2",
             "MEGASCALE_SLICE_ID": str(s), "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1"} for s in (0, 1)]
    assert _run_pods(pods) == ["JOINED 0 2 2 0 3.0", "JOINED 1 2 2 1 3.0"]
