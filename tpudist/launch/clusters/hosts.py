"""The `hosts` cluster source (`--hosts h1,h2`), and the host syntax every host list uses.

A host is written `[user@]host[:port]` (`[user@][v6addr]:port` for IPv6); hosts are workers in the
order given, worker 0 first, and a host listed twice is an error.

    [h.address for h in parse_hosts("a, root@b:2200 ,[::1]:22")]   # ['a', 'b', '::1']
"""

from __future__ import annotations

import re

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict

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
    check_unique(hosts, "--hosts")
    return hosts


def check_unique(hosts: tuple[Host, ...], where: str) -> None:
    """Raises ValueError naming `where` when a host (address and port) is listed twice."""
    seen = set()
    for host in hosts:
        key = (host.address, host.port)
        if key in seen:
            raise ValueError(f"{where}: host {host} is listed twice; give each host once and set its "
                             "process count with slots=N or --nproc-per-host")
        seen.add(key)


class HostsSource(ClusterSource):
    """`--hosts h1,h2`: SSH to each host, in the order given (worker 0 first)."""

    name = "hosts"
    priority = 20

    @classmethod
    def applies(cls, options: ClusterOptions) -> Verdict:
        if options.hosts:
            return Verdict(True, f"--hosts {options.hosts}")
        return Verdict(False, "--hosts not given")

    @classmethod
    def resolve(cls, options: ClusterOptions) -> Cluster:
        return Cluster(source=cls.name, hosts=parse_hosts(options.hosts))
