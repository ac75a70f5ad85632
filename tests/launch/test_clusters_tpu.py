"""The --tpu cluster sources, against stand-ins for the two Google services unreachable from here.

- The GCE metadata server is stood in by a local `http.server` that answers
  `/computeMetadata/v1/instance/attributes/<key>` only with the `Metadata-Flavor: Google` header
  (403 without it, 404 for a missing key, as the real one). Its values are shaped like a real v4
  TPU VM's: `worker-network-endpoints` entries `hostname:uid:ip` with IPs out of order (from
  torch_xla's test/pjrt/test_experimental_tpu.py), `tpu-env` YAML lines `KEY: 'value'` as a real
  v4 VM prints them.
- `gcloud` is stood in by a script on PATH that prints a describe document. The document's shape is
  the Cloud TPU v2 API `Node` resource (REST reference projects.locations.nodes: `acceleratorType`,
  `state`, `health`, `networkEndpoints[].ipAddress/.accessConfig.externalIp`,
  `acceleratorConfig{type,topology}`); where the Google Cloud SDK is installed, a test checks the
  fixture against the SDK's own generated `tpu_v2_messages.Node` class.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time

import pytest

from gcloud_standin import V4_32_NODE, install

from tpudist.launch.clusters import resolve_cluster
from tpudist.launch.clusters.gcloud import GcloudSource
from tpudist.launch.clusters.tpu_metadata import TpuMetadataSource, parse_tpu_env, parse_worker_endpoints
from tpudist.launch.config import ClusterOptions
from tpudist.launch.tpu import tpu_process_env

V4_16_METADATA = {
    "accelerator-type": "v4-16",
    "agent-worker-number": "1",
    "worker-network-endpoints": ("t1v-n-0f996b37-w-0:12345:10.130.0.31,"
                                 "t1v-n-0f996b37-w-1:12346:10.130.0.30"),
    "tpu-env": ("ACCELERATOR_TYPE: 'v4-16'\n"
                "CHIPS_PER_HOST_BOUNDS: '2,2,1'\n"
                "HOST_BOUNDS: '1,1,2'\n"
                "NODE_ID: 'my-slice'\n"
                "TOPOLOGY: '2x2x2'\n"
                "TPU_CHIPS_PER_PROCESS_BOUNDS: '2,2,1'\n"
                "TPU_PROCESS_BOUNDS: '1,1,2'\n"
                "WORKER_ID: '1'\n"
                "ZONE: 'us-central2-b'\n"),
}


def _args(**kw):
    return ClusterOptions(**kw)


class _MetadataStandIn(http.server.BaseHTTPRequestHandler):
    """Stand-in for the GCE metadata server (unreachable here)."""

    attributes: dict[str, str] = {}
    prefix = "/computeMetadata/v1/instance/attributes/"

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_error(403, "Missing Metadata-Flavor:Google header")
            return
        key = self.path[len(self.prefix):] if self.path.startswith(self.prefix) else None
        if key not in self.attributes:
            self.send_error(404)
            return
        body = self.attributes[key].encode()
        self.send_response(200)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata(monkeypatch):
    """Starts the stand-in; returns its attribute dict (edit it before the call under test)."""
    attributes = dict(V4_16_METADATA)
    handler = type("Handler", (_MetadataStandIn,), {"attributes": attributes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.delenv("GCE_METADATA_IP", raising=False)
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.server_address[1]}")
    yield attributes
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_metadata_source_resolves_workers_in_endpoint_order(metadata):
    cluster = TpuMetadataSource.resolve(_args(tpu="local"))
    assert [h.internal_ip for h in cluster.hosts] == ["10.130.0.31", "10.130.0.30"]  # not sorted
    assert [h.address for h in cluster.hosts] == ["10.130.0.31", "10.130.0.30"]
    assert [h.hostname for h in cluster.hosts] == ["t1v-n-0f996b37-w-0", "t1v-n-0f996b37-w-1"]
    assert cluster.accelerator_type == "v4-16" and cluster.topology == "2x2x2"
    assert cluster.tpu_env["HOST_BOUNDS"] == "1,1,2" and cluster.tpu_env["NODE_ID"] == "my-slice"
    assert cluster.local is False


def test_metadata_cluster_gives_torch_xla_per_chip_environment(metadata):
    cluster = TpuMetadataSource.resolve(_args(tpu="my-slice"))
    env = tpu_process_env(cluster, worker=1, local_rank=0, nproc_per_host=4)
    assert (env["CLOUD_TPU_TASK_ID"], env["TPU_PROCESS_PORT"], env["TPU_VISIBLE_CHIPS"],
            env["TPU_PROCESS_BOUNDS"]) == ("4", "8476", "0", "2,2,2")


@pytest.mark.parametrize("tpu, applies, reason", [
    ("local", True, "--tpu=local on a TPU VM (v4-16)"),
    ("my-slice", True, "worker of TPU 'my-slice'"),
    ("projects/p/locations/us-central2-b/nodes/my-slice", True, "worker of TPU 'my-slice'"),
    ("other-slice", False, "belongs to TPU 'my-slice', not 'other-slice'"),
    (None, False, "--tpu not given"),
])
def test_metadata_source_verdicts(metadata, tpu, applies, reason):
    verdict = TpuMetadataSource.applies(_args(tpu=tpu))
    assert verdict.applies is applies
    assert reason in verdict.reason


def test_metadata_source_names_its_tpu_from_instance_id_without_node_id(metadata):
    metadata["tpu-env"] = "ACCELERATOR_TYPE: 'v4-16'\n"
    assert TpuMetadataSource.applies(_args(tpu="my-slice")).applies is False
    metadata["instance-id"] = "my-slice"
    assert TpuMetadataSource.applies(_args(tpu="my-slice")).applies is True


def test_a_gce_vm_without_accelerator_type_is_not_a_tpu_vm(metadata):
    del metadata["accelerator-type"]
    verdict = TpuMetadataSource.applies(_args(tpu="local"))
    assert not verdict.applies and "not a TPU VM" in verdict.reason


def test_one_worker_slice_on_this_vm_runs_locally(metadata):
    metadata.update({"accelerator-type": "v5litepod-8", "agent-worker-number": "0",
                     "worker-network-endpoints": "t1v-n-1-w-0:1:10.0.0.2", "tpu-env": ""})
    cluster = TpuMetadataSource.resolve(_args(tpu="local"))
    assert cluster.local is True and len(cluster.hosts) == 1


def test_gce_metadata_ip_is_honoured(metadata, monkeypatch):
    port = os.environ["GCE_METADATA_HOST"]
    monkeypatch.delenv("GCE_METADATA_HOST")
    monkeypatch.setenv("GCE_METADATA_IP", port)
    assert TpuMetadataSource.applies(_args(tpu="local")).applies


def test_an_http_proxy_in_the_environment_is_not_used_for_metadata(metadata, monkeypatch):
    # The metadata server is link-local; a proxy would answer (or fail) in its place.
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert TpuMetadataSource.resolve(_args(tpu="local")).accelerator_type == "v4-16"


def test_no_metadata_server_means_the_source_does_not_apply(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    verdict = TpuMetadataSource.applies(_args(tpu="my-slice"))
    assert not verdict.applies and "not on a TPU VM" in verdict.reason


def test_a_metadata_server_that_never_answers_is_given_up_on_within_the_probe_deadline(
        monkeypatch):
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        verdict = TpuMetadataSource.applies(_args(tpu="my-slice"))
        elapsed = time.monotonic() - start
    assert not verdict.applies and "within 1 s" in verdict.reason
    assert elapsed < 10  # a deadline, not a hang; the probe's is 1 s


def test_parse_tpu_env_unquotes_yaml_scalars():
    text = "A: 'x'\nB: 'it''s'\nC: \"y\"\nD: 7\n  nested: 'skip'\n\nno colon here\nE: ''\n"
    assert parse_tpu_env(text) == {"A": "x", "B": "it's", "C": "y", "D": "7", "E": ""}


def test_worker_endpoints_as_bare_host_names_and_malformed_ones():
    hosts = parse_worker_endpoints("tpu-w-0,tpu-w-1")
    assert [h.address for h in hosts] == ["tpu-w-0", "tpu-w-1"]
    with pytest.raises(ValueError, match="entry 1 is 'a:b'"):
        parse_worker_endpoints("h:1:10.0.0.1,a:b")


# ---------------------------------------------------------------------------------------------
# gcloud, stood in by a script on PATH.

@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    return install(tmp_path, monkeypatch)


def test_gcloud_source_resolves_workers_in_endpoint_order(gcloud):
    args = _args(tpu="my-slice", zone="us-central2-b", project="my-proj")
    assert GcloudSource.applies(args).applies
    cluster = GcloudSource.resolve(args)
    assert gcloud.calls() == [["compute", "tpus", "tpu-vm", "describe", "my-slice", "--zone",
                               "us-central2-b", "--project", "my-proj", "--format=json"]]
    # Like `gcloud ... tpu-vm ssh`: connect to external IPs; peers use internal ones.
    assert [h.address for h in cluster.hosts] == ["34.1.0.9", "34.1.0.3", "34.1.0.7", "34.1.0.5"]
    assert [h.internal_ip for h in cluster.hosts] == ["10.130.0.9", "10.130.0.3", "10.130.0.7",
                                                      "10.130.0.5"]
    assert (cluster.accelerator_type, cluster.topology) == ("v4-32", "2x2x4")
    env = tpu_process_env(cluster, worker=3, local_rank=0, nproc_per_host=None)
    assert env["TPU_WORKER_HOSTNAMES"] == "10.130.0.9,10.130.0.3,10.130.0.7,10.130.0.5"
    assert env["TPU_HOST_BOUNDS"] == "1,1,4" and env["TPU_WORKER_ID"] == "3"


def test_gcloud_internal_ip_flag_connects_to_internal_ips(gcloud):
    cluster = GcloudSource.resolve(_args(tpu="my-slice", zone="z", internal_ip=True))
    assert cluster.hosts[0].address == "10.130.0.9"


def test_gcloud_zone_and_project_default_to_gclouds_configuration(gcloud):
    gcloud.behaviour["config"] = {"compute/zone": "europe-west4-a", "project": "cfg-proj"}
    gcloud.write()
    GcloudSource.resolve(_args(tpu="my-slice"))
    describe = gcloud.calls()[-1]
    assert describe[describe.index("--zone") + 1] == "europe-west4-a"
    assert describe[describe.index("--project") + 1] == "cfg-proj"


def test_gcloud_without_a_zone_says_how_to_set_one(gcloud):
    with pytest.raises(ValueError, match="pass --zone ZONE or run `gcloud config set compute/zone"):
        GcloudSource.resolve(_args(tpu="my-slice"))


@pytest.mark.parametrize("state, health", [("CREATING", None), ("READY", "UNHEALTHY_MAINTENANCE"),
                                           ("PREEMPTED", "TIMEOUT")])
def test_a_node_that_is_not_ready_and_healthy_is_refused(gcloud, state, health):
    gcloud.behaviour["node"]["state"] = state
    if health is None:
        del gcloud.behaviour["node"]["health"]
    else:
        gcloud.behaviour["node"]["health"] = health
    gcloud.write()
    with pytest.raises(ValueError) as err:
        GcloudSource.resolve(_args(tpu="my-slice", zone="us-central2-b"))
    message = str(err.value)
    assert f"state={state}" in message and "must be READY and HEALTHY" in message
    assert f"health={health or '(unreported)'}" in message and "'my-slice'" in message


def test_an_unknown_accelerator_type_from_gcloud_is_refused_with_the_valid_forms(gcloud):
    gcloud.behaviour["node"]["acceleratorType"] = "v9-32"
    gcloud.write()
    with pytest.raises(ValueError, match="(?s)TPU 'my-slice' in z: unknown TPU accelerator type "
                                         "'v9-32'.*v5litepod-N"):
        GcloudSource.resolve(_args(tpu="my-slice", zone="z"))


def test_a_node_on_two_networks_lists_two_endpoints_per_worker(gcloud):
    node = gcloud.behaviour["node"]
    node["networkConfigs"] = [node.pop("networkConfig"), {"network": "second"}]
    node["networkEndpoints"] = [e for ep in node["networkEndpoints"]
                                for e in (ep, {"ipAddress": "192.168.0.1"})]
    gcloud.write()
    cluster = GcloudSource.resolve(_args(tpu="my-slice", zone="z"))
    assert [h.internal_ip for h in cluster.hosts] == ["10.130.0.9", "10.130.0.3", "10.130.0.7",
                                                      "10.130.0.5"]


def test_gcloud_failure_quotes_gclouds_message(gcloud):
    gcloud.behaviour.update(exit=1, stderr="ERROR: (gcloud.compute.tpus.tpu-vm.describe) "
                                           "NOT_FOUND: Resource 'my-slice' was not found")
    gcloud.write()
    with pytest.raises(ValueError, match=r"exited with 1:\nERROR: .*NOT_FOUND"):
        GcloudSource.resolve(_args(tpu="my-slice", zone="z"))


def test_gcloud_that_hangs_is_stopped_at_the_deadline(gcloud, monkeypatch):
    monkeypatch.setattr("tpudist.launch.clusters.gcloud.GCLOUD_TIMEOUT_S", 1.0)
    gcloud.behaviour["sleep"] = 60
    gcloud.write()
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not finish within 1 s"):
        GcloudSource.resolve(_args(tpu="my-slice", zone="z"))
    assert time.monotonic() - start < 30


def test_missing_gcloud_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcloud here
    with pytest.raises(ValueError, match=r"`gcloud` is not on PATH.*sdk/docs/install"):
        GcloudSource.resolve(_args(tpu="my-slice", zone="z"))


def test_gcloud_does_not_claim_tpu_local():
    assert not GcloudSource.applies(_args(tpu="local")).applies
    assert not GcloudSource.applies(_args()).applies


def test_off_a_tpu_vm_the_registry_picks_gcloud(gcloud, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    cluster = resolve_cluster(_args(tpu="my-slice", zone="us-central2-b"))
    assert cluster.source == "gcloud" and len(cluster.hosts) == 4


def test_on_the_slices_own_vm_the_registry_picks_the_metadata_server(metadata, gcloud):
    cluster = resolve_cluster(_args(tpu="my-slice", zone="us-central2-b"))
    assert cluster.source == "tpu-metadata" and gcloud.calls() == []


def _unrecognized(message) -> list[str]:
    """Field names the SDK's message classes did not recognize, at any depth."""
    from apitools.base.protorpclite import messages
    found = list(message.all_unrecognized_fields())
    for field in message.all_fields():
        if isinstance(field, messages.MessageField):
            value = message.get_assigned_value(field.name)
            for item in (value if field.repeated else [value]) if value is not None else []:
                found += _unrecognized(item)
    return found


def test_describe_fixture_is_a_cloud_tpu_v2_node_per_the_gcloud_sdk(monkeypatch):
    sdk = "/usr/lib/google-cloud-sdk/lib"
    if not os.path.isdir(sdk):
        pytest.skip("Google Cloud SDK not installed; cannot check the fixture against its schema")
    monkeypatch.syspath_prepend(f"{sdk}/third_party")
    monkeypatch.syspath_prepend(sdk)
    encoding = pytest.importorskip("apitools.base.py.encoding")
    tpu_v2 = pytest.importorskip("googlecloudsdk.generated_clients.apis.tpu.v2.tpu_v2_messages")
    node = encoding.DictToMessage(V4_32_NODE, tpu_v2.Node)
    assert _unrecognized(node) == []
    assert str(node.state) == "READY" and str(node.health) == "HEALTHY"
    assert node.networkEndpoints[1].accessConfig.externalIp == "34.1.0.3"
    assert str(node.acceleratorConfig.type) == "V4" and node.acceleratorConfig.topology == "2x2x4"


def test_seed_command_line_dry_run_on_a_v4_32_slice(gcloud, monkeypatch):
    """The seed's command line, verbatim, resolved through the gcloud stand-in: the plan shows every
    worker's process with the TPU environment, the user's --env and the conda env."""
    from launchutil import launch

    gcloud.behaviour["config"] = {"compute/zone": "us-central2-b", "project": "my-proj"}
    gcloud.write()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nobody listens on: no metadata server here
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed.getsockname()[1]}")
    seed = ("--tpu=my-slice --conda-env=torch-xla-1.6 --env ANY_ENV_VAR=VALUE -- "
            "python /path/to/your/code.py --train_arg1 --train_arg2").split()
    r = launch("--dry-run", *seed, timeout=60)
    closed.close()
    assert r.returncode == 0, r.stderr.decode()
    procs = json.loads(r.stdout)["processes"]
    assert [(p["worker"], p["rank"], p["local_rank"], p["host"]) for p in procs] == [
        (0, 0, 0, "34.1.0.9"), (1, 1, 0, "34.1.0.3"), (2, 2, 0, "34.1.0.7"), (3, 3, 0, "34.1.0.5")]
    for p in procs:
        env = p["env"]
        assert p["argv"] == ["python", "/path/to/your/code.py", "--train_arg1", "--train_arg2"]
        assert p["conda_env"] == "torch-xla-1.6" and env["ANY_ENV_VAR"] == "VALUE"
        assert env["TPU_WORKER_ID"] == str(p["worker"]) == env["TPUDIST_WORKER"]
        assert env["TPU_WORKER_HOSTNAMES"] == "10.130.0.9,10.130.0.3,10.130.0.7,10.130.0.5"
        assert env["TPU_ACCELERATOR_TYPE"] == "v4-32" and env["PJRT_DEVICE"] == "TPU"
        assert (env["TPU_HOST_BOUNDS"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == ("1,1,4", "2,2,1")
        assert env["TPUDIST_COORDINATOR_GATE"].startswith("10.130.0.9:")  # worker 0's internal address
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(p["rank"]), "4")
