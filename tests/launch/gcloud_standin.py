"""A stand-in for the gcloud CLI (the Cloud TPU API is unreachable from here), for the TPU tests.

`install(tmp_path, monkeypatch)` puts a script named `gcloud` first on PATH that records its argv
and prints a describe document: `behaviour["nodes"][NAME]` for `describe NAME` when given, else
`behaviour["node"]`. The document's shape is the Cloud TPU v2 API `Node` resource (see
test_clusters_tpu.py, which checks the fixture against the Google Cloud SDK's own message class
where the SDK is installed).
"""

from __future__ import annotations

import json
import os
import stat
import sys

V4_32_NODE = {  # a Cloud TPU v2 API Node, as `gcloud compute tpus tpu-vm describe --format=json`
    "name": "projects/my-proj/locations/us-central2-b/nodes/my-slice",
    "acceleratorType": "v4-32",
    "acceleratorConfig": {"type": "V4", "topology": "2x2x4"},
    "state": "READY",
    "health": "HEALTHY",
    "runtimeVersion": "tpu-ubuntu2204-base",
    "apiVersion": "V2",
    "cidrBlock": "10.130.0.0/20",
    "networkConfig": {"network": "projects/my-proj/global/networks/default",
                      "subnetwork": "projects/my-proj/regions/us-central2/subnetworks/default",
                      "enableExternalIps": True},
    "networkEndpoints": [
        {"ipAddress": "10.130.0.9", "port": 8470, "accessConfig": {"externalIp": "34.1.0.9"}},
        {"ipAddress": "10.130.0.3", "port": 8470, "accessConfig": {"externalIp": "34.1.0.3"}},
        {"ipAddress": "10.130.0.7", "port": 8470, "accessConfig": {"externalIp": "34.1.0.7"}},
        {"ipAddress": "10.130.0.5", "port": 8470, "accessConfig": {"externalIp": "34.1.0.5"}},
    ],
    "schedulingConfig": {},
    "serviceAccount": {"email": "123-compute@developer.gserviceaccount.com",
                       "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
    "id": "5123456789012345678",
    "createTime": "2025-01-01T00:00:00.000000Z",
}

_GCLOUD_STANDIN = """#!{python}
# Stand-in for the gcloud CLI (the Cloud TPU API is unreachable here).
import json, os, sys, time
d = os.environ["TPUDIST_TEST_GCLOUD_DIR"]
argv = sys.argv[1:]
with open(os.path.join(d, "calls.jsonl"), "a") as f:
    f.write(json.dumps(argv) + "\\n")
behaviour = json.load(open(os.path.join(d, "behaviour.json")))
time.sleep(behaviour.get("sleep", 0))
if argv[:2] == ["config", "get-value"]:
    value = behaviour.get("config", {{}}).get(argv[2])
    if value:
        print(value)
    else:
        print("(unset)", file=sys.stderr)
    sys.exit(0)
if behaviour.get("exit"):
    print(behaviour.get("stderr", ""), file=sys.stderr)
    sys.exit(behaviour["exit"])
name = argv[4] if argv[:4] == ["compute", "tpus", "tpu-vm", "describe"] else None
print(json.dumps(behaviour.get("nodes", {{}}).get(name, behaviour["node"]), indent=2))
"""


class GcloudStandIn:
    def __init__(self, directory):
        self.dir = directory
        self.behaviour = {"node": json.loads(json.dumps(V4_32_NODE)), "config": {}}

    def write(self):
        (self.dir / "behaviour.json").write_text(json.dumps(self.behaviour))

    def calls(self):
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
            else []


def install(tmp_path, monkeypatch) -> GcloudStandIn:
    """Puts the stand-in first on PATH for this test; edit `.behaviour`, then call `.write()`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "gcloud"
    script.write_text(_GCLOUD_STANDIN.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("TPUDIST_TEST_GCLOUD_DIR", str(tmp_path))
    stand_in = GcloudStandIn(tmp_path)
    stand_in.write()
    return stand_in
