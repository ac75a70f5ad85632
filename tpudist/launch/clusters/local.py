"""The `local` cluster source: this machine, without SSH (`--local`, and the fallback)."""

from __future__ import annotations

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict


class LocalSource(ClusterSource):
    """This machine, without SSH: `--local`, and the fallback when no cluster flag is given."""

    name = "local"
    priority = 1000  # asked last: any source that recognises its flags or environment wins

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        if options.local:
            return Verdict(True, "--local given")
        flags = [f"--{f}" for f in ("hosts", "hostfile", "tpu") if getattr(options, f)]
        if flags:
            return Verdict(False, f"{', '.join(flags)} given")
        return Verdict(True, "no --hosts, --hostfile or --tpu given: this machine")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        return Cluster(source=cls.name, hosts=(Host("localhost"),), local=True)
