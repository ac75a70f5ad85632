"""The `ray` cluster source (`--ray ADDRESS`): the nodes of a running Ray cluster, one agent per node.

The launcher joins the cluster as a Ray driver (`ray.init(address=ADDRESS)`: `auto`, `host:port`
from a node of the cluster, or `ray://host:10001` through Ray Client from outside it) and takes
every alive node that takes work (a head started with `--num-cpus 0` does not); where some nodes
have TPUs (Ray's `TPU` resource: one node per TPU VM host), only those, in the order of their TPU
worker id (Ray's `ray.io/tpu-worker-id` label) so that ranks
follow the slice's workers. Each host is the node's IP, which is also the address the other hosts
use to reach it (the JAX coordinator's host). The agents are placed through Ray (tpudist/launch/
_ray.py) and dial the launcher at its own IP as the Ray cluster sees it.
"""

from __future__ import annotations

import socket

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict

TPU_WORKER_LABEL = "ray.io/tpu-worker-id"


class RaySource(ClusterSource):
    """`--ray ADDRESS`: every alive node of a Ray cluster (its TPU hosts, where it has some)."""

    name = "ray"
    priority = 20

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        if options.ray:
            return Verdict(True, f"--ray {options.ray}")
        return Verdict(False, "--ray not given")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        try:
            import ray
        except ImportError:
            raise ValueError(f"--ray {options.ray}: Ray is not installed for {_python()}; "
                             "`pip install ray` (the version the cluster runs)") from None
        if not ray.is_initialized():
            try:
                ray.init(address=options.ray, logging_level="ERROR", log_to_driver=False)
            except Exception as e:  # noqa: BLE001 - Ray's many connection errors, said with the fix
                raise ValueError(f"--ray {options.ray}: cannot join the Ray cluster: {first_line(e)}. "
                                 "Give the head's address (`ray status` prints it) or ray://HEAD:10001 "
                                 "from outside the cluster") from None
        chosen = choose_nodes(ray.nodes())
        if not chosen:
            raise ValueError(f"--ray {options.ray}: the Ray cluster has no alive node that takes work "
                             "(every node has 0 CPUs, GPUs and TPUs)")
        hosts = tuple(Host(address=n["NodeManagerAddress"], internal_ip=n["NodeManagerAddress"],
                           hostname=n.get("NodeManagerHostname")) for n in chosen)
        return Cluster(source=cls.name, hosts=hosts, ray_nodes=tuple(n["NodeID"] for n in chosen),
                       control_address=_my_address(options.ray, chosen[0]["NodeManagerAddress"]))


def choose_nodes(nodes: list[dict]) -> list[dict]:
    """The nodes a job runs on, in worker order: the alive nodes with TPUs where there are some, else
    those that take work (a CPU or GPU: a head started with `--num-cpus 0` is left out, as Ray leaves
    it), ordered by TPU worker id, then IP."""
    alive = [n for n in nodes if n.get("Alive")]
    tpu = [n for n in alive if n.get("Resources", {}).get("TPU", 0) > 0]
    chosen = tpu or [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0
                     or n.get("Resources", {}).get("GPU", 0) > 0]
    return sorted(chosen, key=lambda n: (_tpu_worker(n), n["NodeManagerAddress"], n["NodeID"]))


def _tpu_worker(node: dict) -> int:
    labels = node.get("Labels") or {}
    value = labels.get(TPU_WORKER_LABEL, "")
    return int(value) if str(value).isdigit() else 0


def _my_address(address: str, first_node: str) -> str:
    """This machine's IP as the cluster's nodes reach it: Ray's own view when this machine is a node,
    else the source address of a route to the first node."""
    import ray

    if not address.startswith("ray://"):
        try:
            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - fall back to the route below
            pass
    with socket.socket(socket.AF_INET6 if ":" in first_node else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((first_node, 9))  # no packet is sent: this only picks the route's source address
        return s.getsockname()[0]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _python() -> str:
    import sys
    return sys.executable
