"""Is this host's TPU free? The preflight each agent runs before a job starts, and `tpudist doctor`'s.

A TPU chip is a device node: `/dev/accel<N>` (v2-v5p) or a VFIO group `/dev/vfio/<N>` (v5e,
v6e; a group counts only when sysfs shows a Google PCI device, vendor 0x1ae0, in it). Only one process may hold them: libtpu in a second one fails with "The TPU is already in use
by process with pid N". libtpu also keeps a lock file, `/tmp/libtpu_lockfile`, that it deletes
when it exits normally; a process that was killed leaves it behind, and libtpu then refuses to
start although the TPU is free. So, on a host that has TPU device nodes:

- a process (other than this one) with a device node open is "busy": its PID and command line,
  fixed by `sudo kill <pid>`;
- otherwise a lock file that exists is "stale-lock" (a process with it open is "busy" instead),
  fixed by `sudo rm /tmp/libtpu_lockfile`.

Holders are found by reading every process's open files (`/proc/<pid>/fd/*`); another user's
processes can be read only as root, and are counted as `unreadable`. A host without TPU device
nodes is not checked. The paths come from the caller (the launcher passes TPUDIST_TPU_DEVICES and
TPUDIST_LIBTPU_LOCKFILE, or their defaults, in each agent's bootstrap line), so a test can point
them at stand-ins; the check itself is the same.

    found = check("/dev/accel*:/dev/vfio/[0-9]*", "/tmp/libtpu_lockfile")
    for problem in found.problems:
        print(describe(problem))   # "/dev/accel0 is held by PID 4242 (python train.py); fix: sudo kill 4242"

Standard library only, and cheap when there is no TPU: every agent runs it at start-up.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Problem(NamedTuple):
    """Something that keeps a job's processes from this host's TPU (fields as in control.proto)."""

    kind: str  # "busy" or "stale-lock"
    path: str  # the device node(s), comma-separated, or the lock file
    pid: int  # busy: the holder; else 0
    command: str  # busy: the holder's command line
    fix: str  # the command that fixes it


class Check(NamedTuple):
    """The preflight's answer for one host."""

    checked: bool  # False: no TPU device node here, nothing to check
    devices: list[str]
    problems: list[Problem]
    unreadable: int  # processes whose open files could not be read


GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU chip's PCI vendor: tells a TPU's VFIO group from another device's


def device_nodes(patterns: str) -> list[str]:
    """The TPU device nodes that exist: `patterns` is ":"-separated globs.

    Directories are not nodes (Linux's DRM accel subsystem has a `/dev/accel/` of its own), and a
    VFIO group counts only when sysfs shows a Google device in it (VFIO also passes GPUs through)."""
    import glob  # here: only the preflight needs it

    found: list[str] = []
    for pattern in filter(None, patterns.split(":")):
        found += sorted(p for p in glob.glob(pattern) if p not in found and not os.path.isdir(p)
                        and (not p.startswith("/dev/vfio/") or _google_vfio_group(os.path.basename(p))))
    return found


def _google_vfio_group(group: str) -> bool:
    devices = f"/sys/kernel/iommu_groups/{group}/devices"
    try:
        members = os.listdir(devices)
    except OSError:
        return True  # sysfs cannot tell: count it
    for member in members:
        try:
            with open(f"{devices}/{member}/vendor") as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def command_line(pid: int) -> str:
    """Process `pid`'s command line, as `ps` shows it ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def holders(paths: list[str], exclude: set[int]) -> tuple[dict[int, list[str]], int]:
    """Which processes have any of `paths` open: {pid: [path, ...]}, and how many could not be read."""
    wanted = {os.path.realpath(p): p for p in paths}
    found: dict[int, list[str]] = {}
    unreadable = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target in wanted and wanted[target] not in found.get(int(entry), []):
                found.setdefault(int(entry), []).append(wanted[target])
    return found, unreadable


def check(devices: str, lockfile: str, exclude: set[int] | None = None) -> Check:
    """This host's TPU preflight (see the module). `exclude`: PIDs that may hold the TPU (this one)."""
    nodes = device_nodes(devices)
    if not nodes:
        return Check(False, [], [], 0)
    held, unreadable = holders(nodes + [lockfile], {os.getpid()} | (exclude or set()))
    problems = [Problem("busy", ", ".join(paths), pid, command_line(pid) or "?", f"sudo kill {pid}")
                for pid, paths in sorted(held.items())]
    if not problems and os.path.lexists(lockfile):
        problems.append(Problem("stale-lock", lockfile, 0, "", f"sudo rm {lockfile}"))
    return Check(True, nodes, problems, unreadable)


def describe(problem) -> str:
    """One line for a Problem (or the control plane's TpuProblem): what, who, and the fix."""
    if problem.kind == "busy":
        return (f"{problem.path} {'is' if ',' not in problem.path else 'are'} held by PID {problem.pid} "
                f"({problem.command}); fix: {problem.fix}")
    return (f"stale libtpu lock file {problem.path} (no process holds the TPU or the file; libtpu will "
            f"refuse to start while it exists); fix: {problem.fix}")
