"""`--profile DIR`: every host's traces, copied back to the launcher's DIR when the job ends.

The plan gives each host's processes `TPUDIST_PROFILE_DIR` = a job-specific directory on that host
(`plan.host_profile_dir`, under /tmp) and `TPUDIST_PROFILE_STEPS` = "A:B"; each process writes its
traces under `$TPUDIST_PROFILE_DIR/rank<RANK>/`. When the last attempt has ended, successful or
not, `collect` copies every host's directory into DIR, in parallel: over the host's existing SSH
connection (paramiko SFTP; every operation has --connect-timeout), or by a local copy for
`--local`. Each host's directory is removed once copied. Ranks are unique across the job, so DIR
ends up with `rank0/ ... rank<N-1>/`, which TensorBoard reads as one run per rank.

    report = collect(agents, cluster.hosts, job_id, "/home/me/prof", timeout_s=30.0)
    print(report.text())   # where the traces are, and how to open them
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import stat
from collections.abc import Mapping, Sequence

from tpudist.launch._transport import AgentHandle, SshAgent
from tpudist.launch.clusters import Host
from tpudist.launch.plan import host_profile_dir

COLLECT_DEADLINE_S = 3600.0  # all hosts together; each SFTP operation has its own timeout


@dataclasses.dataclass
class ProfileReport:
    """What `collect` copied: per host, (files, bytes) or the error; and where to."""

    local_dir: str
    copied: dict[str, tuple[int, int] | Exception]

    def ranks(self) -> list[int]:
        found = os.listdir(self.local_dir) if os.path.isdir(self.local_dir) else []
        return sorted(int(d[4:]) for d in found if d.startswith("rank") and d[4:].isdigit())

    def text(self) -> str:
        files = sum(r[0] for r in self.copied.values() if not isinstance(r, Exception))
        size = sum(r[1] for r in self.copied.values() if not isinstance(r, Exception))
        lines = [f"tpudist: cannot copy the traces of host {h}: {r}"
                 for h, r in self.copied.items() if isinstance(r, Exception)]
        ranks = self.ranks()
        if not files:
            lines.append(f"tpudist: --profile {self.local_dir}: no host wrote a trace (the program's "
                         "tpudist.fit writes them; did it reach the first step of --profile-steps?)")
            return "\n".join(lines)
        lines += [f"tpudist: traces of {len(ranks)} ranks ({files} files, {size / 1e6:.1f} MB) from "
                  f"{len(self.copied)} hosts are in {self.local_dir}",
                  f"  open them with: tensorboard --logdir {self.local_dir}   (the Profile tab; one run per rank)",
                  "  or load a rank's *.trace.json.gz in https://ui.perfetto.dev"]
        return "\n".join(lines)


def collect(agents: Mapping[int, AgentHandle], hosts: Sequence[Host], job_id: str, local_dir: str,
            timeout_s: float) -> ProfileReport:
    """Copies every host's profile directory into `local_dir` and removes it there."""
    os.makedirs(local_dir, exist_ok=True)
    copied: dict[str, tuple[int, int] | Exception] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(agents)))) as pool:
        futures = {pool.submit(_collect_one, agent, host_profile_dir(job_id, w), local_dir, timeout_s):
                   str(hosts[w]) for w, agent in sorted(agents.items())}
        done, late = concurrent.futures.wait(futures, timeout=COLLECT_DEADLINE_S)
        for future in done:
            copied[futures[future]] = future.exception() or future.result()
        for future in late:
            copied[futures[future]] = TimeoutError(f"not done within {COLLECT_DEADLINE_S:g} s")
    return ProfileReport(local_dir, dict(sorted(copied.items())))


def _collect_one(agent: AgentHandle, remote: str, local_dir: str, timeout_s: float) -> tuple[int, int]:
    if not isinstance(agent, SshAgent):  # --local: this machine's own directory
        if not os.path.isdir(remote):
            return 0, 0
        counted = _count(remote)
        shutil.copytree(remote, local_dir, dirs_exist_ok=True)
        shutil.rmtree(remote, ignore_errors=True)
        return counted
    import paramiko

    try:
        sftp = agent.client.open_sftp()
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise OSError(f"no SFTP session ({e or type(e).__name__}); does its sshd_config have "
                      f"`Subsystem sftp`? The traces stay in {remote} there") from None
    try:
        sftp.get_channel().settimeout(timeout_s)
        counted = _get_tree(sftp, remote, local_dir)
        if counted != (0, 0):
            _remove_tree(sftp, remote)
        return counted
    finally:
        sftp.close()


def _count(path: str) -> tuple[int, int]:
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files]
    return len(sizes), sum(sizes)


def _get_tree(sftp, remote: str, local: str) -> tuple[int, int]:
    """Copies directory `remote` into `local` (created as needed); (files, bytes). Missing: (0, 0)."""
    try:
        entries = sftp.listdir_attr(remote)
    except FileNotFoundError:
        return 0, 0
    os.makedirs(local, exist_ok=True)
    files = size = 0
    for entry in entries:
        source, target = f"{remote}/{entry.filename}", os.path.join(local, entry.filename)
        if stat.S_ISDIR(entry.st_mode or 0):
            n, b = _get_tree(sftp, source, target)
            files, size = files + n, size + b
        elif stat.S_ISREG(entry.st_mode or 0):
            sftp.get(source, target)
            files, size = files + 1, size + (entry.st_size or 0)
    return files, size


def _remove_tree(sftp, remote: str) -> None:
    for entry in sftp.listdir_attr(remote):
        path = f"{remote}/{entry.filename}"
        if stat.S_ISDIR(entry.st_mode or 0):
            _remove_tree(sftp, path)
        else:
            sftp.remove(path)
    sftp.rmdir(remote)
