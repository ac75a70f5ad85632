"""The `gcloud` cluster source: `--tpu NAME` from anywhere, described by the gcloud CLI.

It runs `gcloud compute tpus tpu-vm describe NAME --zone Z [--project P] --format=json`, a Cloud
TPU v2 API Node: `acceleratorType`, `state`, `health`, `networkEndpoints[i]` = worker i
(`ipAddress`, `accessConfig.externalIp`; K per worker on K networks), `acceleratorConfig {type,
topology}`. `--zone`/`--project` default to gcloud's configured ones. A node that is not
READY, or not HEALTHY, is refused with both in the message. Like `gcloud ... tpu-vm ssh`, the
launcher connects to a worker's external IP when it has one (`--internal-ip`: always the internal
one); peers always use internal IPs.

It applies when `--tpu NAME` is given and NAME is not `local` (the metadata source, asked first,
takes a slice this VM belongs to), and to every `--tpu NAME1,NAME2,...`: one job over several
slices, each described (in parallel) and checked on its own; slices of different accelerator types
are refused, naming them. The hosts are then slice-major (all of NAME1's workers, then NAME2's).

Example::

    options = ClusterOptions(tpu="my-slice", zone="us-central2-b")
    if GcloudSource.applies(options).applies:
        cluster = GcloudSource.resolve(options)   # Hosts in worker order, accelerator type, topology
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
from collections.abc import Sequence

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict
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
        names = [tpu_name(n) for n in options.tpu_names]
        if not names:
            return Verdict(False, "--tpu not given")
        if names == [TPU_LOCAL]:
            return Verdict(False, "--tpu=local means this TPU VM's own slice, and only its "
                                  "metadata server can say which that is")
        if TPU_LOCAL in names or "" in names:
            return Verdict(False, f"--tpu={options.tpu}: name every slice of a multislice job "
                                  "(`local` or an empty name cannot be one of them)")
        if len(names) > 1:
            return Verdict(True, f"--tpu={options.tpu}: {len(names)} slices, each described by "
                                 "`gcloud compute tpus tpu-vm describe`")
        return Verdict(True, f"--tpu={names[0]}: `gcloud compute tpus tpu-vm describe` lists its "
                             "workers")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        names = [tpu_name(n) for n in options.tpu_names]
        assert names, "resolve() called without --tpu"
        zone = options.zone or gcloud_config("compute/zone")
        if not zone:
            raise ValueError(f"--tpu={options.tpu} needs the TPU's zone: pass --zone ZONE or run "
                             "`gcloud config set compute/zone ZONE`")
        project = options.project or gcloud_config("project")
        if len(names) == 1:
            return cls.describe(names[0], zone, project, options.internal_ip)
        if len(set(names)) != len(names):
            raise ValueError(f"--tpu={options.tpu} names a slice twice; give each slice once")
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
            futures = [pool.submit(cls.describe, n, zone, project, options.internal_ip) for n in names]
            done = [f.exception() or f.result() for f in futures]  # each has gcloud's own deadline
        failed = [str(d) for d in done if isinstance(d, Exception)]
        if failed:
            raise ValueError(f"{len(failed)} of the {len(names)} slices of --tpu={options.tpu} cannot "
                             "be used; nothing was started:\n  " + "\n  ".join(failed))
        return multislice(cls.name, done)

    @classmethod
    def describe(cls, tpu: str, zone: str, project: str | None, internal_ip: bool) -> Cluster:
        """One slice, READY and HEALTHY, as a cluster of its own."""
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
        hosts = node_hosts(node, internal_ip=internal_ip)
        if not accelerator_type or not hosts:
            raise ValueError(f"{where}: the describe document has no acceleratorType or no "
                             "networkEndpoints")
        topology = (node.get("acceleratorConfig") or {}).get("topology") or None
        cluster = Cluster(source=cls.name, hosts=hosts, accelerator_type=accelerator_type,
                          topology=topology, name=tpu)
        try:
            cluster_slice(cluster)  # an unknown type or a worker count that does not fit fails here
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return cluster


def multislice(source: str, slices: Sequence[Cluster]) -> Cluster:
    """One cluster over `slices` (each a resolved slice), hosts slice-major.

    Every slice must have the same accelerator type and topology: libtpu joins equal slices over
    DCN. Raises ValueError naming each slice and its type otherwise.
    """
    shapes = {(c.accelerator_type, cluster_slice(c).topology) for c in slices}
    if len(shapes) > 1:
        listed = ", ".join(f"{c.name} is {c.accelerator_type} ({cluster_slice(c).topology})" for c in slices)
        raise ValueError(f"the slices of a multislice job must be of one accelerator type and "
                         f"topology: {listed}; nothing was started. Name slices of the same type.")
    first = slices[0]
    return Cluster(source=source, hosts=tuple(h for c in slices for h in c.hosts),
                   accelerator_type=first.accelerator_type, topology=first.topology,
                   name=",".join(c.name or "?" for c in slices), num_slices=len(slices),
                   host_slices=tuple(i for i, c in enumerate(slices) for _ in c.hosts),
                   slices=tuple(slices))
