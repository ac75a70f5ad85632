"""Cluster sources: where the hosts of a job come from. The registry, and the types every source uses
(defined in `_base`).

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

from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict
from tpudist.launch.config import ClusterOptions

__all__ = ["Cluster", "ClusterSource", "Host", "Verdict", "SOURCE_MODULES", "sources", "verdicts",
           "resolve_cluster", "choose_cluster", "with_slices"]

SOURCE_MODULES = tuple(f"tpudist.launch.clusters.{name}"
                       for name in ("local", "hosts", "hostfile", "ray", "tpu_metadata", "gcloud", "slurm"))


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
                     "Pass --local, --hosts, --hostfile, --tpu or --ray.")


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
