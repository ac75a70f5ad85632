"""The types every cluster source uses (`Host`, `Cluster`, `Verdict`, the self-registering
`ClusterSource` base), apart from the registry's queries so that the package imports a source
without a cycle."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tpudist.launch.config import ClusterOptions


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine of the job, as the launcher reaches it."""

    address: str  # host name or IP the transport connects to ("localhost" for --local)
    user: str | None = None  # SSH user; None: ~/.ssh/config or the current user
    port: int | None = None  # SSH port; None: ~/.ssh/config or 22
    slots: int | None = None  # processes on this host; None: --nproc-per-host or the source's default
    internal_ip: str | None = None  # address peers use to reach this host (TPU worker network endpoint)
    hostname: str | None = None  # the host's own name (TPU_WORKER_HOSTNAMES), when known

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{self.address}{port}"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What a source resolved: the hosts in worker order, plus what it knows of the accelerator.

    A job over several slices lists every slice's hosts, slice-major (all of slice 0, then slice
    1, ...); `host_slices` gives each host's slice and, on TPU, `slices` each slice as a cluster of
    its own (its hosts, type, topology, name). With `num_slices` > 1 and one host, that host's
    processes form the slices (an emulated multislice job on one machine).
    """

    source: str
    hosts: tuple[Host, ...]
    local: bool = False  # True: run on this machine without SSH
    accelerator_type: str | None = None  # e.g. "v4-32", "v5litepod-16"; None off TPU
    tpu_env: dict[str, str] = dataclasses.field(default_factory=dict)  # metadata `tpu-env`, wins over tables
    topology: str | None = None  # e.g. "2x2x4", when the source reports it
    name: str | None = None  # the TPU's name, when the source knows it
    num_slices: int = 1  # slices joined over DCN
    host_slices: tuple[int, ...] = ()  # each host's slice, host order; (): one slice, or one host's processes
    slices: tuple["Cluster", ...] = ()  # a TPU multislice job: each slice's own cluster, slice order
    ray_nodes: tuple[str, ...] = ()  # --ray: each host's Ray node id, host order (agents placed by Ray)
    control_address: str | None = None  # where agents dial the launcher directly, over TLS (no SSH tunnel)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A source's answer to "do you apply?", with the reason either way."""

    applies: bool
    reason: str


class ClusterSource:
    """Base of every cluster source. Subclasses register themselves by name."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 100  # lower is asked first
    registry: ClassVar[dict[str, type["ClusterSource"]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"cluster source {cls.__qualname__} must set a name")
        ClusterSource.registry[cls.name] = cls

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        """Whether this source should resolve the hosts for these options, and why."""
        raise NotImplementedError

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        """The hosts in worker order. Raises ValueError with the fix on bad input."""
        raise NotImplementedError
