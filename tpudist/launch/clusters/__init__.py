"""Cluster sources: where the hosts of a job come from. The registry, and the types every source uses.

A cluster source is a small stateless class that registers itself by subclassing `ClusterSource`.
The launcher asks each registered source, in `priority` order, whether it applies to the launch's
`ClusterOptions` (`applies`), and the first that does resolves the hosts (`resolve`). Every source
says why it does or does not apply, which `tpudist doctor` and `--verbose` print.

    cluster = resolve_cluster(ClusterOptions(hosts="10.0.0.2,10.0.0.3"))
    assert [h.address for h in cluster.hosts] == ["10.0.0.2", "10.0.0.3"]

Adding a source is one class in one module of this package, listed in `SOURCE_MODULES` so that it
is imported (and registers) the first time the sources are asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
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


SOURCE_MODULES = tuple(f"tpudist.launch.clusters.{name}"
                       for name in ("local", "hosts", "hostfile", "tpu_metadata", "gcloud", "slurm"))


def sources() -> list[type[ClusterSource]]:
    """Registered sources in the order they are asked."""
    for module in SOURCE_MODULES:
        importlib.import_module(module)
    return sorted(ClusterSource.registry.values(), key=lambda s: (s.priority, s.name))


def verdicts(options: ClusterOptions) -> list[tuple[str, Verdict]]:
    """Every source's verdict, for `tpudist doctor` and --verbose."""
    return [(source.name, source.applies(options)) for source in sources()]


def resolve_cluster(options: ClusterOptions) -> Cluster:
    """The first applicable source's cluster."""
    for source in sources():
        if source.applies(options).applies:
            return source.resolve(options)
    lines = "\n".join(f"  {name}: {v.reason}" for name, v in verdicts(options))
    raise ValueError(f"no cluster source applies to this command line:\n{lines}\n"
                     "Pass --local, --hosts, --hostfile or --tpu.")


def choose_cluster(options: ClusterOptions) -> Cluster:
    """An explicit --local wins; otherwise the first source that applies (local when none does).

    `--num-slices` then groups the hosts into slices (see `with_slices`)."""
    if options.local:
        from tpudist.launch.clusters.local import LocalSource

        cluster = LocalSource.resolve(options)
    else:
        cluster = resolve_cluster(options)
    return with_slices(cluster, options.num_slices)


def with_slices(cluster: Cluster, num_slices: int | None) -> Cluster:
    """`cluster` split into `num_slices` slices of contiguous hosts (one host: of its processes).

    A source that found the slices itself (several --tpu names, a hostfile's `slice=`) keeps
    them; `--num-slices` must then agree. Raises ValueError showing the arithmetic.
    """
    if num_slices is None or num_slices == cluster.num_slices:
        return cluster
    if cluster.num_slices > 1:
        raise ValueError(f"--num-slices {num_slices}, but the {cluster.source!r} source found "
                         f"{cluster.num_slices} slices; leave --num-slices out or make them agree")
    if cluster.accelerator_type:  # a TPU slice cannot be cut into slices: libtpu sees one
        raise ValueError(f"--num-slices {num_slices}: the slices of a TPU job are the TPUs it names "
                         f"(--tpu {cluster.name or '...'} is one); name each slice: --tpu A,B,...")
    n = len(cluster.hosts)
    if n == 1:  # one machine: its processes form the slices (checked against their count in the plan)
        return dataclasses.replace(cluster, num_slices=num_slices)
    if n % num_slices:
        raise ValueError(f"--num-slices {num_slices} does not divide the {n} hosts of the "
                         f"{cluster.source!r} source ({n} / {num_slices} is not whole): each slice is "
                         "a contiguous block of hosts of the same size")
    per = n // num_slices
    return dataclasses.replace(cluster, num_slices=num_slices,
                               host_slices=tuple(i // per for i in range(n)))
