"""Cluster sources: where the hosts of a job come from.

A cluster source is a small stateless class that registers itself by subclassing `ClusterSource`.
The launcher asks each registered source, in `priority` order, whether it applies to the command
line (`applies`), and the first that does resolves the hosts (`resolve`). Every source can say why
it does not apply, which `tpudist doctor` and `--verbose` print.

Adding a source is one class in one module under `tpudist/launch/`, listed in `SOURCE_MODULES`
so that it is imported (and registers) the first time the sources are asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import ClassVar


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
    """What a source resolved: the hosts in worker order, plus what it knows of the accelerator."""

    source: str
    hosts: tuple[Host, ...]
    local: bool = False  # True: run on this machine without SSH
    accelerator_type: str | None = None  # e.g. "v4-32", "v5litepod-16"; None off TPU
    tpu_env: dict[str, str] = dataclasses.field(default_factory=dict)  # metadata `tpu-env`, wins over tables
    topology: str | None = None  # e.g. "2x2x4", when the source reports it


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
    def applies(cls, args: argparse.Namespace) -> Verdict:
        """Whether this source should resolve the hosts for these launcher arguments, and why."""
        raise NotImplementedError

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Cluster:
        """The hosts in worker order. Raises ValueError with the fix on bad input."""
        raise NotImplementedError


SOURCE_MODULES = ("tpudist.launch.sources_basic", "tpudist.launch.sources_tpu", "tpudist.launch.sources_slurm")


def _load_sources() -> None:
    for module in SOURCE_MODULES:
        importlib.import_module(module)


def sources() -> list[type[ClusterSource]]:
    """Registered sources in the order they are asked."""
    _load_sources()
    return sorted(ClusterSource.registry.values(), key=lambda s: (s.priority, s.name))


def verdicts(args: argparse.Namespace) -> list[tuple[str, Verdict]]:
    """Every source's verdict, for `tpudist doctor` and --verbose."""
    return [(source.name, source.applies(args)) for source in sources()]


def resolve_cluster(args: argparse.Namespace) -> Cluster:
    """The first applicable source's cluster."""
    for source in sources():
        if source.applies(args).applies:
            return source.resolve(args)
    lines = "\n".join(f"  {name}: {v.reason}" for name, v in verdicts(args))
    raise ValueError(f"no cluster source applies to this command line:\n{lines}\n"
                     "Pass --local, --hosts, --hostfile or --tpu.")
