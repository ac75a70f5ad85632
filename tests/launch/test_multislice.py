"""One job over several slices (issue 19, item 1): plans through the gcloud stand-in, refusals, and an
emulated 2-slice CPU job whose processes are grouped into slices with the MEGASCALE_* variables.

`gcloud` is stood in by a script on PATH (gcloud_standin.py; the Cloud TPU API is unreachable from
here) that answers `describe NAME` with each slice's own Cloud TPU v2 API Node document.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import textwrap

import numpy as np
import pytest
from gcloud_standin import V4_32_NODE, install
from launchutil import launch

from tpudist import contract
from tpudist.launch.args import parse_args
from tpudist.launch.clusters import choose_cluster
from tpudist.launch.plan import Ports, build_plan


def _node(name: str, accelerator_type: str, topology: str, subnet: int, workers: int,
          state: str = "READY", health: str = "HEALTHY") -> dict:
    """A READY Cloud TPU v2 Node shaped like the fixture, `workers` endpoints out of IP order."""
    node = copy.deepcopy(V4_32_NODE)
    node.update(name=f"projects/my-proj/locations/us-east5-a/nodes/{name}", acceleratorType=accelerator_type,
                state=state, health=health)
    node["acceleratorConfig"] = {"type": accelerator_type.split("-")[0].upper(), "topology": topology}
    node["networkEndpoints"] = [
        {"ipAddress": f"10.{subnet}.0.{20 - w}", "port": 8470, "accessConfig": {"externalIp": f"34.{subnet}.0.{w}"}}
        for w in range(workers)]
    return node


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    stand_in = install(tmp_path, monkeypatch)
    stand_in.behaviour["config"] = {"compute/zone": "us-east5-a", "project": "my-proj"}
    stand_in.write()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # no metadata server here: the probe of a single name fails at once
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed.getsockname()[1]}")
    yield stand_in
    closed.close()


def _slices(gcloud, *nodes: dict) -> None:
    gcloud.behaviour["nodes"] = {n["name"].rsplit("/", 1)[1]: n for n in nodes}
    gcloud.write()


def _dry_run(*flags: str) -> list[dict]:
    r = launch(*flags, "--dry-run", "--", "python", "train.py", timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)["processes"]


@pytest.mark.parametrize("accelerator_type, topology, workers, slices, bounds", [
    ("v5p-16", "2x2x2", 2, 2, ("1,1,2", "2,2,1")),
    ("v6e-16", "4x4", 4, 3, ("2,2,1", "2,2,1")),
])
def test_multislice_dry_run_plan(gcloud, accelerator_type, topology, workers, slices, bounds):
    names = [f"slice-{chr(ord('a') + s)}" for s in range(slices)]
    _slices(gcloud, *(_node(n, accelerator_type, topology, 100 + s, workers) for s, n in enumerate(names)))
    procs = _dry_run(f"--tpu={','.join(names)}")
    describes = [c for c in gcloud.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "describe"]]
    assert sorted(c[4] for c in describes) == names  # one describe per slice
    world = slices * workers
    assert [p["rank"] for p in procs] == list(range(world))  # unique across the job
    assert [p["slice"] for p in procs] == [r // workers for r in range(world)]  # slice-major
    slice0_worker0 = "10.100.0.20"
    for p in procs:
        env, s, w = p["env"], p["slice"], p["rank"] % workers
        internal = [f"10.{100 + s}.0.{20 - i}" for i in range(workers)]
        assert p["host"] == f"34.{100 + s}.0.{w}" and p["worker"] == p["rank"]  # worker: the job's host index
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(p["rank"]), str(world))
        # each slice keeps its own TPU topology
        assert env["TPU_WORKER_ID"] == str(w)
        assert env["TPU_WORKER_HOSTNAMES"] == ",".join(internal)
        assert env["TPU_ACCELERATOR_TYPE"] == accelerator_type and env["TPU_TOPOLOGY"] == topology
        assert (env["TPU_HOST_BOUNDS"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == bounds
        # the MEGASCALE variables, as xpk/JobSet and Ray's TPU launcher set them
        assert env[contract.NUM_SLICES] == str(slices) and env[contract.SLICE_ID] == str(s)
        assert env[contract.SLICE_COORDINATOR] == slice0_worker0 and env[contract.SLICE_PORT] == "8081"
        # one JAX coordinator for the job: slice 0 worker 0 (its gate; each host's own socket relays there)
        assert env[contract.COORDINATOR_GATE].rsplit(":", 1)[0] == slice0_worker0
        assert env[contract.COORDINATOR] == "unix:${TPUDIST_PRIVATE_DIR}/tpudist-dry-run-0-w%d.sock" % p["worker"]
        assert env[contract.JAX_COORDINATOR_ADDRESS] == env[contract.COORDINATOR]
        assert contract.JobEnv.from_environ(env).rank == p["rank"]


def test_a_single_slice_sets_no_megascale_variable(gcloud):
    _slices(gcloud, _node("solo", "v5p-16", "2x2x2", 100, 2))
    for p in _dry_run("--tpu=solo"):
        assert p["slice"] == 0 and not any(k.startswith("MEGASCALE_") for k in p["env"]), p["env"]


def test_slices_of_different_accelerator_types_are_refused_naming_each(gcloud):
    _slices(gcloud, _node("slice-a", "v5p-16", "2x2x2", 100, 2), _node("slice-b", "v5p-32", "2x2x4", 101, 4))
    r = launch("--tpu=slice-a,slice-b", "--", "python", "-c", "print('ran')", timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and b"ran" not in r.stdout, err
    assert "slice-a is v5p-16 (2x2x2)" in err and "slice-b is v5p-32 (2x2x4)" in err
    assert "nothing was started" in err


def test_a_slice_that_is_not_ready_is_refused_naming_it(gcloud):
    _slices(gcloud, _node("slice-a", "v6e-16", "4x4", 100, 4),
            _node("slice-b", "v6e-16", "4x4", 101, 4, state="CREATING", health=None))
    r = launch("--tpu=slice-a,slice-b", "--", "python", "-c", "print('ran')", timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and b"ran" not in r.stdout, err
    assert "1 of the 2 slices of --tpu=slice-a,slice-b cannot be used" in err
    assert "TPU 'slice-b' in us-east5-a (project my-proj) is state=CREATING" in err
    assert "'slice-a'" not in err


def test_num_slices_must_agree_with_the_tpu_names(gcloud):
    _slices(gcloud, _node("slice-a", "v5p-16", "2x2x2", 100, 2), _node("slice-b", "v5p-16", "2x2x2", 101, 2))
    r = launch("--tpu=slice-a,slice-b", "--num-slices", "3", "--dry-run", "--", "true", timeout=60)
    assert r.returncode == 2 and b"--num-slices 3, but the 'gcloud' source found 2 slices" in r.stderr


def test_one_tpu_slice_is_not_cut_into_slices(gcloud):
    _slices(gcloud, _node("solo", "v5p-16", "2x2x2", 100, 2))
    r = launch("--tpu=solo", "--num-slices", "2", "--dry-run", "--", "true", timeout=60)
    assert r.returncode == 2 and b"the slices of a TPU job are the TPUs it names (--tpu solo is one)" in r.stderr


def test_local_processes_form_contiguous_slices():
    procs = _dry_run("--local", "--nproc-per-host", "4", "--num-slices", "2")
    assert [(p["rank"], p["slice"]) for p in procs] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    for p in procs:
        env = p["env"]
        assert env[contract.NUM_SLICES] == "2" and env[contract.SLICE_ID] == str(p["slice"])
        assert env[contract.SLICE_COORDINATOR] == "127.0.0.1"


def test_hosts_form_slices_in_contiguous_blocks():
    config = parse_args(["--hosts", "a,b,c,d", "--num-slices", "2", "--nproc-per-host", "2", "--", "true"])
    plan = build_plan(config.procs, choose_cluster(config.cluster), Ports(1, 2), job_id="j")
    assert [(p.host.address, p.rank, p.slice) for p in plan] == [
        ("a", 0, 0), ("a", 1, 0), ("b", 2, 0), ("b", 3, 0), ("c", 4, 1), ("c", 5, 1), ("d", 6, 1), ("d", 7, 1)]


def test_hostfile_slice_column_orders_hosts_slice_major(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0 slots=2 slice=1\nh1 slots=2 slice=0\nh2 slots=2 slice=1\nh3 slots=2 slice=0\n")
    config = parse_args(["--hostfile", str(hostfile), "--", "true"])
    plan = build_plan(config.procs, choose_cluster(config.cluster), Ports(1, 2), job_id="j")
    assert [(p.host.address, p.worker, p.slice) for p in plan if p.local_rank == 0] == [
        ("h1", 0, 0), ("h3", 1, 0), ("h0", 2, 1), ("h2", 3, 1)]


@pytest.mark.parametrize("flags, hostfile, message", [
    (["--local", "--nproc-per-host", "3", "--num-slices", "2"], None,
     "3 processes do not split into 2 slices of equal size (3 / 2 is not whole)"),
    (["--hosts", "a,b,c", "--num-slices", "2"], None,
     "--num-slices 2 does not divide the 3 hosts of the 'hosts' source (3 / 2 is not whole)"),
    ([], "a slots=4 slice=0\nb slots=2 slice=1\nc slots=2 slice=1\nd slots=2 slice=1\n",
     "the slices have different numbers of processes (slice 0: 4, slice 1: 6); every slice must run "
     "10 / 2 = 5"),
    ([], "a slice=0\nb\n", "no slice=; when one line of"),
    ([], "a slice=0\nb slice=2\n", "no host is in slice 1"),
])
def test_slices_that_do_not_divide_are_refused_showing_the_arithmetic(tmp_path, flags, hostfile, message):
    if hostfile:
        path = tmp_path / "hosts"
        path.write_text(hostfile)
        flags = ["--hostfile", str(path), *flags]
    r = launch(*flags, "--dry-run", "--", "true")
    assert r.returncode == 2 and message in r.stderr.decode(), r.stderr.decode()


SLICES = textwrap.dedent("""
    import os
    import numpy as np
    import tpudist
    tpudist.init()
    rank, world = tpudist.process_index(), tpudist.process_count()
    slices, slice_id = int(os.environ["MEGASCALE_NUM_SLICES"]), int(os.environ["MEGASCALE_SLICE_ID"])
    per = world // slices
    x = np.arange(3, dtype=np.float32) * (rank + 1)
    # ICI-like: inside each slice; DCN-like: across slices, between processes of the same place
    ici = tpudist.all_reduce(x, groups=[list(range(s * per, (s + 1) * per)) for s in range(slices)])
    dcn = tpudist.all_reduce(x, groups=[list(range(i, world, per)) for i in range(per)])
    print("SLICE", rank, slice_id, os.environ["MEGASCALE_COORDINATOR_ADDRESS"],
          " ".join(map(repr, ici.tolist())), "|", " ".join(map(repr, dcn.tolist())), flush=True)
""")


@pytest.mark.slow
def test_an_emulated_two_slice_cpu_job_groups_processes_by_slice(tmp_path):
    script = tmp_path / "slices.py"
    script.write_text(SLICES)
    r = launch("--local", "--nproc-per-host", "4", "--num-slices", "2", "--", "python", str(script),
               timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = {}
    for line in r.stdout.decode().splitlines():
        m = re.match(r"^\[w0 r(\d) localhost\] SLICE (\d) (\d) (\S+) (.*) \| (.*)$", line)
        if m:
            assert m[1] == m[2] and m[4] == "127.0.0.1"
            rows[int(m[2])] = (int(m[3]), [float(v) for v in m[5].split()], [float(v) for v in m[6].split()])
    assert sorted(rows) == [0, 1, 2, 3], r.stdout.decode()
    x = [np.arange(3, dtype=np.float32) * (rank + 1) for rank in range(4)]  # the numpy reference
    for rank, (slice_id, ici, dcn) in rows.items():
        assert slice_id == rank // 2
        np.testing.assert_allclose(ici, x[2 * slice_id] + x[2 * slice_id + 1])
        np.testing.assert_allclose(dcn, x[rank % 2] + x[rank % 2 + 2])
