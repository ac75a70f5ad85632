"""The `gcloud` cluster source: `--tpu NAME` from anywhere, described by the gcloud CLI.

It runs `gcloud compute tpus tpu-vm describe NAME --zone Z [--project P] --format=json`, a Cloud
TPU v2 API Node: `acceleratorType`, `state`, `health`, `networkEndpoints[i]` = worker i
(`ipAddress`, `accessConfig.externalIp`; K per worker on K networks), `acceleratorConfig {type,
topology}`. `--zone`/`--project` default to gcloud's configured ones. A node that is not
READY, or not HEALTHY, is refused with both in the message. Like `gcloud ... tpu-vm ssh`, the
launcher connects to a worker's external IP when it has one (`--internal-ip`: always the internal
one); peers always use internal IPs.

It applies when `--tpu NAME` is given and NAME is not `local` (the metadata source, asked first,
takes a slice this VM belongs to).

Example::

    options = ClusterOptions(tpu="my-slice", zone="us-central2-b")
    if GcloudSource.applies(options).applies:
        cluster = GcloudSource.resolve(options)   # Hosts in worker order, accelerator type, topology
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters import Cluster, ClusterSource, Host, Verdict
from tpudist.launch.clusters.tpu_metadata import TPU_LOCAL, tpu_name
from tpudist.launch.tpu.env import cluster_slice

GCLOUD_TIMEOUT_S = 60.0


def _run_gcloud(argv: Sequence[str], timeout: float | None = None) -> str:
    """gcloud's stdout. Raises ValueError with gcloud's own message and the fix on failure."""
    timeout = GCLOUD_TIMEOUT_S if timeout is None else timeout
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        raise ValueError("--tpu needs the gcloud CLI to find the slice's workers, and `gcloud` is "
                         "not on PATH. Install the Google Cloud CLI "
                         "(https://cloud.google.com/sdk/docs/install) and run `gcloud auth login`, "
                         "or launch from a worker of the slice (--tpu=local), or pass the workers "
                         "with --hosts/--hostfile.")
    command = [gcloud, *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"`gcloud {' '.join(argv)}` did not finish within {timeout:g} s; check "
                         "the network and `gcloud auth list`") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise ValueError(f"`gcloud {' '.join(argv)}` exited with {done.returncode}:\n{tail}")
    return done.stdout


def gcloud_config(prop: str) -> str | None:
    """A gcloud configuration property (`project`, `compute/zone`), None when unset."""
    value = _run_gcloud(["config", "get-value", prop]).strip()
    return value if value and value != "(unset)" else None


def node_hosts(node: dict, internal_ip: bool = False) -> tuple[Host, ...]:
    """A Cloud TPU v2 API Node's workers as Hosts, in `networkEndpoints` order (= worker id).

    A node on several networks (`networkConfigs` with K entries) lists K endpoints per worker,
    worker by worker; the first of each K is the worker's primary one (as `gcloud ... tpu-vm ssh`
    reads it).
    """
    per_worker = max(1, len(node.get("networkConfigs") or []))
    endpoints = (node.get("networkEndpoints") or [])[::per_worker]
    hosts = []
    for i, endpoint in enumerate(endpoints):
        ip = endpoint.get("ipAddress")
        if not ip:
            raise ValueError(f"TPU {node.get('name')!r}: the endpoint of worker {i} has no "
                             "ipAddress")
        external = (endpoint.get("accessConfig") or {}).get("externalIp")
        hosts.append(Host(address=ip if internal_ip or not external else external,
                          internal_ip=ip))
    return tuple(hosts)


class GcloudSource(ClusterSource):
    """The slice named by --tpu, described by the gcloud CLI."""

    name = "gcloud"
    priority = 30

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        tpu = tpu_name(options.tpu)
        if not tpu:
            return Verdict(False, "--tpu not given")
        if tpu == TPU_LOCAL:
            return Verdict(False, "--tpu=local means this TPU VM's own slice, and only its "
                                  "metadata server can say which that is")
        return Verdict(True, f"--tpu={tpu}: `gcloud compute tpus tpu-vm describe` lists its "
                             "workers")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        tpu = tpu_name(options.tpu)
        assert tpu, "resolve() called without --tpu"
        zone = options.zone or gcloud_config("compute/zone")
        if not zone:
            raise ValueError(f"--tpu={tpu} needs the TPU's zone: pass --zone ZONE or run "
                             "`gcloud config set compute/zone ZONE`")
        project = options.project or gcloud_config("project")
        argv = ["compute", "tpus", "tpu-vm", "describe", tpu, "--zone", zone]
        if project:
            argv += ["--project", project]
        argv += ["--format=json"]
        out = _run_gcloud(argv)
        try:
            node = json.loads(out)
        except json.JSONDecodeError as e:
            raise ValueError(f"`gcloud {' '.join(argv)}` printed no JSON ({e}): {out[:200]!r}") \
                from None
        where = f"TPU {tpu!r} in {zone}" + (f" (project {project})" if project else "")
        state, health = node.get("state", "STATE_UNSPECIFIED"), node.get("health", "(unreported)")
        if state != "READY" or health != "HEALTHY":
            detail = f" ({node['healthDescription']})" if node.get("healthDescription") else ""
            raise ValueError(f"{where} is state={state}, health={health}{detail}; it must be READY "
                             "and HEALTHY. Wait for it, or check `gcloud compute tpus tpu-vm "
                             "describe` and recreate or repair it.")
        accelerator_type = node.get("acceleratorType")
        hosts = node_hosts(node, internal_ip=options.internal_ip)
        if not accelerator_type or not hosts:
            raise ValueError(f"{where}: the describe document has no acceleratorType or no "
                             "networkEndpoints")
        topology = (node.get("acceleratorConfig") or {}).get("topology") or None
        cluster = Cluster(source=cls.name, hosts=hosts, accelerator_type=accelerator_type,
                          topology=topology)
        try:
            cluster_slice(cluster)  # an unknown type or a worker count that does not fit fails here
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return cluster
