"""--ray ADDRESS: a job placed through a Ray cluster instead of SSH.

A real Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`: a head with no CPUs,
which a job leaves out as Ray does, and two worker nodes on 127.0.0.2 and 127.0.0.3), real
processes, the real control plane over TLS. What a user relies on: the same environment contract,
log streaming, a collective across the nodes, fail-fast with the root cause named, restarts after
a lost agent, and nothing left running.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import numpy as np
import pytest
from launchutil import environ_of, job_pids, launch, parent_of, start_launcher, wait_lines, wait_until

pytestmark = pytest.mark.slow
ray_cluster_utils = pytest.importorskip("ray.cluster_utils")


@pytest.fixture(scope="module")
def ray_address():
    cluster = ray_cluster_utils.Cluster(initialize_head=True,
                                        head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for ip in ("127.0.0.2", "127.0.0.3"):
            cluster.add_node(num_cpus=1, node_ip_address=ip)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


COLLECTIVE = """
import os, sys, numpy as np, tpudist
tpudist.init()
r = tpudist.process_index()
out = tpudist.all_reduce(np.arange(4.0) * (r + 1))
print("rank", r, "of", tpudist.process_count(), "on", os.environ["TPUDIST_HOST"], "sum", out.tolist(),
      "argv", sys.argv[1:], "K", os.environ["K"], flush=True)
"""


def test_a_job_runs_one_process_per_ray_node_and_a_collective_crosses_them(ray_address, marker):
    odd = "a b; $HOME 'q' \\"
    r = launch("--ray", ray_address, "--env", f"K={odd}", "--env", f"RAY_TEST_MARKER={marker}", "--",
               sys.executable, "-c", COLLECTIVE, odd, timeout=120)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    want = (np.arange(4.0) * 1 + np.arange(4.0) * 2).tolist()  # numpy's sum of both ranks' arrays
    for rank, host in ((0, "127.0.0.2"), (1, "127.0.0.3")):
        line = f"[w{rank} r{rank} {host}] rank {rank} of 2 on {host} sum {want} argv [{odd!r}] K {odd}"
        assert line in out, out
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes outlived the job"


def test_a_failure_on_one_ray_node_stops_the_other_and_names_the_root_cause(ray_address, marker):
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(600)"
    start = time.monotonic()
    r = launch("--ray", ray_address, "--env", f"RAY_TEST_MARKER={marker}", "--", sys.executable, "-c", code,
               timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert "root cause (first observed failure): rank 1 on 127.0.0.3 (worker 1): exit 3" in err, err
    assert "SIGTERM (stopped)" in err, err
    assert time.monotonic() - start < 60
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes outlived the job"


def test_a_lost_ray_actor_restarts_the_job_on_a_new_one(ray_address, marker):
    code = ("import os, time; a = os.environ['TPUDIST_RESTART']; "
            "print('attempt', a, 'rank', os.environ['RANK'], flush=True); time.sleep(600 if a == '0' else 0)")
    proc = start_launcher("--ray", ray_address, "--max-restarts", "1", "--env", f"RAY_TEST_MARKER={marker}",
                          "--", sys.executable, "-c", code)
    try:
        wait_lines(proc, 2, b"attempt 0 rank", timeout=90)
        rank1 = [p for p in job_pids(marker) if environ_of(p).get(b"RANK") == b"1"]
        assert rank1
        actor = parent_of(parent_of(rank1[0]))  # rank 1 -> its agent -> the Ray actor that started it
        os.kill(actor, signal.SIGKILL)
        code = proc.wait(timeout=90)
        out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    finally:
        proc.kill()
    assert code == 0, err[-3000:]
    # whichever comes first: Ray's report of the dead actor, or the agent's goodbye (its parent died)
    assert re.search(r"restarting \(1/1 restarts\): rank 1's host 127\.0\.0\.3 was lost \(host agent gone: "
                     r"[^\n]*Ray actor", err), err
    assert "attempt 1 rank 0" in out and "attempt 1 rank 1" in out, out
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes outlived the job"


def test_ray_nodes_are_chosen_as_ray_schedules_work():
    # node records as ray.nodes() returns them (a stand-in: no TPU node here)
    from tpudist.launch.clusters.ray import choose_nodes

    def node(ip, resources, alive=True, labels=None):
        return {"NodeID": ip, "NodeManagerAddress": ip, "Alive": alive, "Resources": resources, "Labels": labels or {}}

    head, a, b = node("10.0.0.1", {}), node("10.0.0.3", {"CPU": 8}), node("10.0.0.2", {"CPU": 8})
    assert [n["NodeManagerAddress"] for n in choose_nodes([head, a, b, node("10.0.0.4", {"CPU": 8}, False)])] \
        == ["10.0.0.2", "10.0.0.3"]  # no head with 0 CPUs, no dead node, by IP
    tpus = [node(f"10.1.0.{i}", {"CPU": 96, "TPU": 4}, labels={"ray.io/tpu-worker-id": str(w)})
            for i, w in ((1, 2), (2, 0), (3, 1))]
    assert [n["NodeManagerAddress"] for n in choose_nodes([head, a, *tpus])] == ["10.1.0.2", "10.1.0.3", "10.1.0.1"]
