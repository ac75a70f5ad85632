"""The plain cluster sources: this machine (`--local`), `--hosts h1,h2` and `--hostfile FILE`.

A host is written `[user@]host[:port]` (`[user@][v6addr]:port` for IPv6). A hostfile is the MPI /
DeepSpeed format: one host per line, optional `slots=N` (processes on that host), `#` comments and
blank lines::

    # workers of the slice
    10.0.0.2 slots=4
    ubuntu@10.0.0.3:2222 slots=4

    cluster = resolve_cluster(parse_args(["--hostfile", "hosts", "--", "python", "train.py"]))
"""

from __future__ import annotations

import argparse
import re

from tpudist.launch._cluster import Cluster, ClusterSource, Host, Verdict

_HOST_RE = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?:\[(?P<v6>[0-9A-Fa-f:.%\w]+)\]|(?P<name>[^@:\s\[\]]+))"
                      r"(?::(?P<port>\d+))?$")


def parse_host(spec: str) -> Host:
    """`[user@]host[:port]` -> Host. Raises ValueError naming the spec."""
    match = _HOST_RE.match(spec.strip())
    if not match:
        raise ValueError(f"host {spec!r} is not of the form [user@]host[:port] (IPv6: [user@][addr]:port)")
    port = match["port"]
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"host {spec!r}: port {port} is not in 1..65535")
    return Host(address=match["v6"] or match["name"], user=match["user"], port=int(port) if port else None)


def parse_hosts(value: str) -> tuple[Host, ...]:
    """`--hosts h1,h2,...` -> hosts in worker order; an empty item or a duplicate is an error."""
    specs = [s.strip() for s in value.split(",")]
    if not value.strip() or any(not s for s in specs):
        raise ValueError(f"--hosts {value!r} has an empty host name; write --hosts host1,host2,...")
    hosts = tuple(parse_host(s) for s in specs)
    _check_unique(hosts, "--hosts")
    return hosts


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
    _check_unique(tuple(hosts), path)
    return tuple(hosts)


def _check_unique(hosts: tuple[Host, ...], where: str) -> None:
    seen = set()
    for host in hosts:
        key = (host.address, host.port)
        if key in seen:
            raise ValueError(f"{where}: host {host} is listed twice; give each host once and set its "
                             "process count with slots=N or --nproc-per-host")
        seen.add(key)


class LocalSource(ClusterSource):
    """This machine, without SSH: `--local`, and the fallback when no cluster flag is given."""

    name = "local"
    priority = 1000  # asked last: any source that recognises its flags or environment wins

    @classmethod
    def applies(cls, args: argparse.Namespace) -> Verdict:
        if getattr(args, "local", False):
            return Verdict(True, "--local given")
        flags = [f"--{f}" for f in ("hosts", "hostfile", "tpu") if getattr(args, f, None)]
        if flags:
            return Verdict(False, f"{', '.join(flags)} given")
        return Verdict(True, "no --hosts, --hostfile or --tpu given: this machine")

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Cluster:
        return Cluster(source=cls.name, hosts=(Host("localhost"),), local=True)


class HostsSource(ClusterSource):
    """`--hosts h1,h2`: SSH to each host, in the order given (worker 0 first)."""

    name = "hosts"
    priority = 20

    @classmethod
    def applies(cls, args: argparse.Namespace) -> Verdict:
        if getattr(args, "hosts", None):
            return Verdict(True, f"--hosts {args.hosts}")
        return Verdict(False, "--hosts not given")

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Cluster:
        return Cluster(source=cls.name, hosts=parse_hosts(args.hosts))


class HostfileSource(ClusterSource):
    """`--hostfile FILE`: the hosts of an MPI/DeepSpeed hostfile, in file order."""

    name = "hostfile"
    priority = 20

    @classmethod
    def applies(cls, args: argparse.Namespace) -> Verdict:
        if getattr(args, "hostfile", None):
            return Verdict(True, f"--hostfile {args.hostfile}")
        return Verdict(False, "--hostfile not given")

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Cluster:
        return Cluster(source=cls.name, hosts=parse_hostfile(args.hostfile))
