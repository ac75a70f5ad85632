"""The `hostfile` cluster source: `--hostfile FILE`, the MPI / DeepSpeed format.

One host per line (`[user@]host[:port]`), optional `slots=N` (processes on that host; `max_slots=`
is accepted and ignored), `#` comments and blank lines::

    # workers of the slice
    10.0.0.2 slots=4
    ubuntu@10.0.0.3:2222 slots=4

A job over several slices gives every line a `slice=S` (0, 1, ...): the hosts are then taken slice
by slice (file order within a slice), so ranks are slice-major. A bad line is a ValueError naming
`FILE:LINE`.
"""

from __future__ import annotations

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict
from tpudist.launch.clusters.hosts import check_unique, parse_host


def parse_hostfile(path: str) -> tuple[Host, ...]:
    """Reads an MPI/DeepSpeed hostfile. A bad line raises ValueError naming `path:line`."""
    return parse_hostfile_slices(path)[0]


def parse_hostfile_slices(path: str) -> tuple[tuple[Host, ...], tuple[int, ...]]:
    """The hostfile's hosts and, when its lines have `slice=`, each host's slice (else ())."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --hostfile {path}: {e.strerror}") from None
    hosts, slices, slice_lines = [], [], []
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
        slots = slice_id = None
        for option in options:
            key, sep, value = option.partition("=")
            if key not in ("slots", "max_slots", "slice") or not sep:
                raise ValueError(f"{where}: unknown option {option!r} in {raw.strip()!r}; "
                                 "a line is `host slots=N` (several slices: `host slots=N slice=S`)")
            if not value.isdigit() or int(value) < (0 if key == "slice" else 1):
                raise ValueError(f"{where}: {key}={value!r} must be a "
                                 + ("slice number 0, 1, ..." if key == "slice" else "positive integer"))
            if key == "slots":  # max_slots (MPI's oversubscription limit) does not change the count
                slots = int(value)
            elif key == "slice":
                slice_id = int(value)
        hosts.append(Host(host.address, host.user, host.port, slots=slots))
        slices.append(slice_id)
        slice_lines.append(where)
    if not hosts:
        raise ValueError(f"--hostfile {path} lists no hosts")
    check_unique(tuple(hosts), path)
    if all(s is None for s in slices):
        return tuple(hosts), ()
    missing = [w for w, s in zip(slice_lines, slices) if s is None]
    if missing:
        raise ValueError(f"{missing[0]}: no slice=; when one line of {path} names its slice, every "
                         "line must")
    unused = sorted(set(range(max(slices) + 1)) - set(slices))
    if unused:
        raise ValueError(f"--hostfile {path}: slices are numbered 0..{max(slices)} but no host is in "
                         f"slice {', '.join(map(str, unused))}")
    order = sorted(range(len(hosts)), key=lambda i: slices[i])  # stable: file order within a slice
    return tuple(hosts[i] for i in order), tuple(slices[i] for i in order)


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
        hosts, slices = parse_hostfile_slices(options.hostfile)
        return Cluster(source=cls.name, hosts=hosts, num_slices=max(slices, default=0) + 1,
                       host_slices=slices)
