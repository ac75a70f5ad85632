"""The `hostfile` cluster source: `--hostfile FILE`, the MPI / DeepSpeed format.

One host per line (`[user@]host[:port]`), optional `slots=N` (processes on that host; `max_slots=`
is accepted and ignored), `#` comments and blank lines::

    # workers of the slice
    10.0.0.2 slots=4
    ubuntu@10.0.0.3:2222 slots=4

A bad line is a ValueError naming `FILE:LINE`.
"""

from __future__ import annotations

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters import Cluster, ClusterSource, Host, Verdict
from tpudist.launch.clusters.hosts import check_unique, parse_host


def parse_hostfile(path: str) -> tuple[Host, ...]:
    """Reads an MPI/DeepSpeed hostfile. A bad line raises ValueError naming `path:line`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --hostfile {path}: {e.strerror}") from None
    hosts = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        host_spec, *options = line.split()
        try:
            host = parse_host(host_spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        slots = None
        for option in options:
            key, sep, value = option.partition("=")
            if key not in ("slots", "max_slots") or not sep:
                raise ValueError(f"{where}: unknown option {option!r} in {raw.strip()!r}; "
                                 "a line is `host slots=N`")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{where}: {key}={value!r} must be a positive integer")
            if key == "slots":  # max_slots (MPI's oversubscription limit) does not change the count
                slots = int(value)
        hosts.append(Host(host.address, host.user, host.port, slots=slots))
    if not hosts:
        raise ValueError(f"--hostfile {path} lists no hosts")
    check_unique(tuple(hosts), path)
    return tuple(hosts)


class HostfileSource(ClusterSource):
    """`--hostfile FILE`: the hosts of an MPI/DeepSpeed hostfile, in file order."""

    name = "hostfile"
    priority = 20

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        if options.hostfile:
            return Verdict(True, f"--hostfile {options.hostfile}")
        return Verdict(False, "--hostfile not given")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        return Cluster(source=cls.name, hosts=parse_hostfile(options.hostfile))
