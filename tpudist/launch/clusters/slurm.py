"""Cluster source for SLURM allocations: the nodes of the job the launcher runs inside.

Inside `salloc`/`sbatch`, SLURM describes the allocation in the environment:

- `SLURM_JOB_NODELIST` (older: `SLURM_NODELIST`): the nodes, in SLURM's compressed host-list
  syntax, e.g. `tpu-[0-3,7],gpu1` = tpu-0 tpu-1 tpu-2 tpu-3 tpu-7 gpu1, `n[001-003]` = n001 n002
  n003 (a range keeps the zero padding of its lower bound), `r[1-2]-n[1-2]` = r1-n1 r1-n2 r2-n1
  r2-n2;
- `SLURM_NTASKS_PER_NODE` (set by `--ntasks-per-node`): processes per node; otherwise
  `SLURM_TASKS_PER_NODE`, per node and compressed, e.g. `2(x3),1` = 2 2 2 1.

It applies when `SLURM_JOB_NODELIST` is set and no explicit --hosts, --hostfile, --tpu or --local
is given: explicit flags win over the environment. Nodes are reached by their SLURM names, in the
allocation's order (worker i = the i-th node); each Host's `slots` carries SLURM's task count.

Example::

    expand_nodelist("tpu-[0-1,7],gpu1")   # ['tpu-0', 'tpu-1', 'tpu-7', 'gpu1']
    expand_tasks_per_node("2(x2),1", 3)   # [2, 2, 1]
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping

from tpudist.launch.config import ClusterOptions
from tpudist.launch.clusters._base import Cluster, ClusterSource, Host, Verdict

SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_NODELIST = "SLURM_NODELIST"  # the pre-2.x name, still set
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
SLURM_JOB_ID = "SLURM_JOB_ID"


def _split_top_level(text: str) -> list[str]:
    """Splits on commas outside brackets: `a[1,2],b` -> ['a[1,2]', 'b']."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"host list {text!r}: '[' is never closed")
    items.append(text[start:])
    return items


def _expand_range_group(group: str, text: str) -> list[str]:
    """`0-3,7` -> ['0', '1', '2', '3', '7']; `001-003` keeps the padding of its lower bound."""
    values = []
    for part in group.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise ValueError(f"host list {text!r}: {part!r} in [{group}] is not N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"host list {text!r}: range {part!r} runs backwards")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list as host names, in order (duplicates kept, as SLURM does).

    Raises ValueError on unbalanced brackets, empty items, or ranges that are not N-M with N <= M.
    """
    if not text or not text.strip():
        raise ValueError("host list is empty")
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if not item:
            raise ValueError(f"host list {text!r} has an empty item")
        # "r[1-2]-n[01-02]" -> literals and groups, expanded as a product (leftmost outermost).
        pieces = re.split(r"\[([^\]]*)\]", item)
        choices = [[p] if i % 2 == 0 else _expand_range_group(p, text)
                   for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(text: str, nodes: int) -> list[int]:
    """`SLURM_TASKS_PER_NODE` (`2(x3),1`) or a single count (`4`) as one count per node.

    Raises ValueError when the counts do not match the number of nodes.
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"tasks per node {text!r}: {part!r} is not N or N(xM)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) == 1:
        counts *= nodes
    if len(counts) != nodes:
        raise ValueError(f"tasks per node {text!r} gives {len(counts)} counts for {nodes} nodes")
    return counts


def _explicit_flag(options: ClusterOptions) -> str | None:
    for flag in ("hosts", "hostfile", "tpu", "ray", "local"):
        if getattr(options, flag):
            return f"--{flag}"
    return None


class SlurmSource(ClusterSource):
    """The nodes of the SLURM allocation the launcher runs in."""

    name = "slurm"
    priority = 60  # after every explicit flag's source: the environment is only a default

    @classmethod
    def applies(cls, options: ClusterOptions, environ: Mapping[str, str] | None = None) -> Verdict:
        env = os.environ if environ is None else environ
        nodelist = env.get(SLURM_JOB_NODELIST) or env.get(SLURM_NODELIST)
        if not nodelist:
            return Verdict(False, f"{SLURM_JOB_NODELIST} is not set (not inside a SLURM "
                                  "allocation)")
        flag = _explicit_flag(options)
        if flag:
            return Verdict(False, f"{flag} given; explicit flags win over the SLURM allocation "
                                  f"{nodelist}")
        job = env.get(SLURM_JOB_ID)
        return Verdict(True, f"inside SLURM job {job or '(no id)'} on {nodelist}")

    @classmethod
    def resolve(cls, options: ClusterOptions, environ: Mapping[str, str] | None = None) -> Cluster:
        env = os.environ if environ is None else environ
        nodelist = env.get(SLURM_JOB_NODELIST) or env.get(SLURM_NODELIST)
        if not nodelist:
            raise ValueError(f"{SLURM_JOB_NODELIST} is not set; run inside salloc/sbatch")
        try:
            names = expand_nodelist(nodelist)
        except ValueError as e:
            raise ValueError(f"{SLURM_JOB_NODELIST}={nodelist!r}: {e}") from None
        tasks_var = next((v for v in (SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) if env.get(v)),
                         None)
        slots: list[int | None] = [None] * len(names)
        if tasks_var:
            try:
                slots = list(expand_tasks_per_node(env[tasks_var], len(names)))
            except ValueError as e:
                raise ValueError(f"{tasks_var}={env[tasks_var]!r} with {SLURM_JOB_NODELIST}="
                                 f"{nodelist!r}: {e}") from None
        hosts = tuple(Host(address=n, hostname=n, slots=s) for n, s in zip(names, slots))
        # A one-node allocation that is this machine runs here directly, without SSH.
        local = len(names) == 1 and names[0] == socket.gethostname().split(".")[0]
        return Cluster(source=cls.name, hosts=hosts, local=local)
