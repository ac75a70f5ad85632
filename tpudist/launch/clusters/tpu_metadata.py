"""The `tpu-metadata` cluster source: `--tpu NAME` on a worker of the slice, from its metadata server.

The GCE metadata server answers `instance/attributes/<key>` with header `Metadata-Flavor: Google`:

- `accelerator-type`: "v4-32";
- `worker-network-endpoints`: `hostname:uid:ip,...` (or bare host names), one entry per worker;
  the list index is the worker id and the IPs are not sorted, so the order is kept as is;
- `tpu-env`: YAML lines `KEY: 'value'` (ACCELERATOR_TYPE, TOPOLOGY, HOST_BOUNDS,
  CHIPS_PER_HOST_BOUNDS, NODE_ID = the TPU's name, ...), whose values win over tpudist's table;
- `agent-worker-number`: this VM's worker id.

It applies when `--tpu` is given, the metadata server answers within a second with an accelerator
type, and either `--tpu=local` or the name matches this VM's TPU (tpu-env's NODE_ID, else the
`instance-id` attribute). A VM of another TPU, or one whose name it cannot tell, leaves the slice
to gcloud. The server's address honours the override variables Google's client libraries read,
`GCE_METADATA_HOST` then `GCE_METADATA_IP`; by default its link-local IP, which needs no DNS, so
the probe fails fast off Google Cloud.

Example::

    options = ClusterOptions(tpu="local")
    if TpuMetadataSource.applies(options).applies:
        cluster = TpuMetadataSource.resolve(options)   # Hosts in worker order, accelerator type, topology
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict
from tpudist.launch.tpu.env import cluster_slice

METADATA_HOST_ENV = "GCE_METADATA_HOST"  # google-auth's override: host[:port] of the server
METADATA_IP_ENV = "GCE_METADATA_IP"  # google-auth's and JAX's override: its IP[:port]
METADATA_DEFAULT_HOST = "169.254.169.254"  # the GCE metadata server's fixed link-local address
PROBE_TIMEOUT_S = 1.0  # "are we on a TPU VM?" must not slow down launches elsewhere
FETCH_TIMEOUT_S = 10.0
TPU_LOCAL = "local"  # --tpu=local: the TPU this VM belongs to


class MetadataError(ValueError):
    """The metadata server did not answer a key it must answer."""


def metadata_base_url() -> str:
    """`http://<host>/computeMetadata/v1/instance/attributes/`, honouring the override variables."""
    host = (os.environ.get(METADATA_HOST_ENV) or os.environ.get(METADATA_IP_ENV)
            or METADATA_DEFAULT_HOST)
    return f"http://{host}/computeMetadata/v1/instance/attributes/"


def get_attribute(key: str, timeout: float = FETCH_TIMEOUT_S) -> str | None:
    """One instance attribute's text, or None when the server says it does not exist (404).

    Raises MetadataError (a ValueError) when the server cannot be reached within `timeout`
    seconds or answers anything else.
    """
    url = metadata_base_url() + key
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    # No proxies: the metadata server is link-local, and an HTTP proxy would answer for it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise MetadataError(f"metadata server {url} answered HTTP {e.code}") from None
    except (OSError, ValueError) as e:  # URLError, timeouts and refusals are OSErrors
        raise MetadataError(f"no answer from the metadata server {url} within {timeout:g} s "
                            f"({e})") from None


def parse_tpu_env(text: str) -> dict[str, str]:
    """The metadata `tpu-env` attribute (YAML lines `KEY: 'value'`) as a dict of strings."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or not key.strip() or line.startswith((" ", "\t", "#")):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1].replace("''", "'")  # YAML single quotes escape ' as ''
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        env[key.strip()] = value
    return env


def parse_worker_endpoints(text: str) -> list[Host]:
    """`worker-network-endpoints` as Hosts in worker order (the list index is the worker id).

    Entries are `hostname:uid:ip` or, in newer images, a bare host name.
    """
    hosts = []
    for i, entry in enumerate(e.strip() for e in text.strip().split(",")):
        parts = entry.split(":")
        if len(parts) == 3 and parts[2]:
            hosts.append(Host(address=parts[2], internal_ip=parts[2], hostname=parts[0] or None))
        elif len(parts) == 1 and parts[0]:
            hosts.append(Host(address=parts[0], internal_ip=parts[0], hostname=parts[0]))
        else:
            raise ValueError(f"worker-network-endpoints entry {i} is {entry!r}; expected "
                             f"'hostname:uid:ip' or a host name (whole value: {text!r})")
    return hosts


def tpu_name(name: str | None) -> str | None:
    """The short name of a TPU given as a name or as projects/P/locations/Z/nodes/NAME."""
    return name.rstrip("/").rsplit("/", 1)[-1] if name else name


class TpuMetadataSource(ClusterSource):
    """The slice this TPU VM belongs to, from its metadata server."""

    name = "tpu-metadata"
    priority = 20

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        if len(options.tpu_names) > 1:
            return Verdict(False, f"--tpu={options.tpu} names {len(options.tpu_names)} slices; a "
                                  "metadata server knows only its own, so gcloud describes them")
        tpu = tpu_name(options.tpu)
        if not tpu:
            return Verdict(False, "--tpu not given")
        try:
            accelerator_type = get_attribute("accelerator-type", timeout=PROBE_TIMEOUT_S)
        except MetadataError as e:
            return Verdict(False, f"not on a TPU VM: {e}")
        if not accelerator_type:
            return Verdict(False, f"the metadata server at {metadata_base_url()} has no "
                                  "accelerator-type: this VM is not a TPU VM")
        if tpu == TPU_LOCAL:
            return Verdict(True, f"--tpu=local on a TPU VM ({accelerator_type.strip()})")
        try:
            own = cls._own_name(timeout=PROBE_TIMEOUT_S)
        except MetadataError as e:
            return Verdict(False, f"cannot tell which TPU this VM belongs to: {e}")
        if own is None:
            return Verdict(False, f"this TPU VM's metadata does not name its TPU, so --tpu={tpu} "
                                  "is left to gcloud (use --tpu=local for this VM's own slice)")
        if own != tpu:
            return Verdict(False, f"this VM belongs to TPU {own!r}, not {tpu!r}")
        return Verdict(True, f"this VM is a worker of TPU {tpu!r} ({accelerator_type.strip()})")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        accelerator_type = (get_attribute("accelerator-type") or "").strip()
        endpoints = get_attribute("worker-network-endpoints")
        if not accelerator_type or not endpoints:
            raise MetadataError(f"the metadata server at {metadata_base_url()} lacks "
                                "accelerator-type or worker-network-endpoints; is this a TPU VM?")
        tpu_env = parse_tpu_env(get_attribute("tpu-env") or "")
        hosts = tuple(parse_worker_endpoints(endpoints))
        worker = (get_attribute("agent-worker-number") or "").strip()
        # A one-worker slice whose worker is this VM runs here directly, without SSH.
        local = len(hosts) == 1 and worker in ("", "0")
        cluster = Cluster(source=cls.name, hosts=hosts, local=local,
                          accelerator_type=tpu_env.get("ACCELERATOR_TYPE") or accelerator_type,
                          tpu_env=tpu_env, topology=tpu_env.get("TOPOLOGY") or None,
                          name=tpu_env.get("NODE_ID") or None)
        cluster_slice(cluster)  # an unknown type or a worker count that does not fit fails here
        return cluster

    @staticmethod
    def _own_name(timeout: float) -> str | None:
        node_id = parse_tpu_env(get_attribute("tpu-env", timeout=timeout) or "").get("NODE_ID")
        if node_id:
            return node_id
        instance_id = get_attribute("instance-id", timeout=timeout)
        return instance_id.strip() if instance_id and instance_id.strip() else None
