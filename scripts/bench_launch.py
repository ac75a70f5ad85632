#!/usr/bin/env python3
"""Benchmark: how long `python -m tpudist.xla_dist` takes to start and to end a job over SSH.

For 1, 8, 32 and 64 loopback hosts (127.0.0.2, 127.0.0.3, ... served by a real sshd, see
scripts/_sshd.py) it measures, in the same run:

  ssh fan-out    the anchor: `ssh host true` to every host at once with the OpenSSH client
  pdsh           `pdsh -R ssh -w <all hosts> true`
  tpudist start  launcher start until every process has printed its first line
  stop (^C)      SIGINT to the launcher until it has exited, every process stopped on every host
  fail-fast      rank 0 exits 3 until the launcher has exited with 3, every other process stopped
  launcher cpu   the launcher process's own CPU seconds for one job
  machine cpu    CPU seconds the whole machine spent (/proc/stat: sshd, shells, agents, clients)
                 during the ssh fan-out and during tpudist's start: where the ratio comes from
  left           processes of the job still alive afterwards (must be 0)

One process per host runs `echo ready; exec sleep 600`. All hosts share this machine's cores, so
per-host work (sshd, bash, the Python agent) adds up here where a real pod runs it in parallel on
every host. sshd runs with an empty ~/.bashrc where possible (see scripts/_sshd.py; the JSON says
so), the same for every tool. Each number is the best of --repeat runs, since the machine may be
shared. Prints a table and JSON.

    .venv/bin/python scripts/bench_launch.py --hosts 1,8,32,64 --repeat 2 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _sshd import LoopbackSshd  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def machine_cpu() -> float:
    """CPU seconds this machine has been busy since boot, all cores (user, nice, system, irq,
    softirq, steal; not idle or iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


def ssh_fanout(sshd: LoopbackSshd, timeout: float) -> tuple[float, float]:
    """(seconds, machine CPU seconds) of `ssh host true` to every host at once."""
    cpu0, t0 = machine_cpu(), time.monotonic()
    procs = [subprocess.Popen(["ssh", *sshd.ssh_options(), a, "true"]) for a in sshd.addresses]
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"ssh fan-out failed: exit codes {codes}")
    return time.monotonic() - t0, machine_cpu() - cpu0


def pdsh(sshd: LoopbackSshd, timeout: float) -> float:
    env = {**os.environ, "PDSH_SSH_ARGS": " ".join(sshd.ssh_options()) + " %h"}
    t0 = time.monotonic()
    subprocess.run(["pdsh", "-R", "ssh", "-f", str(len(sshd.addresses)), "-w", ",".join(sshd.addresses),
                    "true"], env=env, check=True, timeout=timeout)
    return time.monotonic() - t0


# Every process prints "ready" and sleeps; rank 0 exits 3 once the trigger file exists ("fail" mode).
PAYLOAD = ('echo ready; if [ "$RANK" = 0 ] && [ "$1" != - ]; then '
           'while [ ! -e "$1" ]; do sleep 0.02; done; exit 3; fi; exec sleep 600')


def tpudist(sshd: LoopbackSshd, timeout: float, mode: str) -> dict:
    """One job: start time until every process ran, then the time to end it by SIGINT ("stop") or
    by rank 0 failing ("fail"); the launcher's own CPU seconds; processes left afterwards."""
    marker = f"tpudist-bench-{uuid.uuid4().hex[:8]}"
    trigger = pathlib.Path(f"/tmp/{marker}.trigger")
    n = len(sshd.addresses)
    cmd = [sys.executable, "-m", "tpudist.xla_dist", *sshd.launcher_flags(), "--fanout", str(n),
           "--", "sh", "-c", PAYLOAD, "sh", str(trigger) if mode == "fail" else "-", marker]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, t0 = machine_cpu(), time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    ready = 0
    try:
        while ready < n:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the launcher exited early: {proc.stderr.read().decode()[-2000:]}")
            ready += line.rstrip().endswith(b"ready")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"only {ready}/{n} processes ran within {timeout} s")
        started, start_cpu = time.monotonic() - t0, machine_cpu() - cpu0
        t1 = time.monotonic()
        if mode == "fail":
            trigger.touch()
        else:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=timeout)
        ended = time.monotonic() - t1
        if code != (3 if mode == "fail" else 130):
            raise RuntimeError(f"launcher exited {code} in {mode} mode: {proc.stderr.read().decode()[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        trigger.unlink(missing_ok=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    time.sleep(0.5)  # agents end their processes on their own after the launcher; give them a moment
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return {"start": started, "end": ended, "launcher_cpu": cpu, "start_machine_cpu": start_cpu, "left": len(left)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,8,32,64", help="host counts to measure")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is reported")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    ap.add_argument("--machine-bashrc", action="store_true",
                    help="keep this machine's ~/.bashrc in every SSH session (default: an empty one)")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.hosts.split(",")]:
        with LoopbackSshd(n, clean_login=not args.machine_bashrc) as sshd:
            ssh_fanout(sshd, args.timeout)  # warm-up: page cache, sshd's first forks
            runs: dict[str, list] = {k: [] for k in ("ssh", "ssh_cpu", "pdsh", "start", "start_cpu", "stop",
                                                     "fail", "cpu", "left")}
            for _ in range(args.repeat):
                elapsed, cpu = ssh_fanout(sshd, args.timeout)
                runs["ssh"].append(elapsed)
                runs["ssh_cpu"].append(cpu)
                runs["pdsh"].append(pdsh(sshd, args.timeout))
                stop = tpudist(sshd, args.timeout, "stop")
                fail = tpudist(sshd, args.timeout, "fail")
                runs["start"] += [stop["start"], fail["start"]]
                runs["start_cpu"] += [stop["start_machine_cpu"], fail["start_machine_cpu"]]
                runs["stop"].append(stop["end"])
                runs["fail"].append(fail["end"])
                runs["cpu"] += [stop["launcher_cpu"], fail["launcher_cpu"]]
                runs["left"] += [stop["left"], fail["left"]]
        row = {"hosts": n, "ssh_fanout_s": min(runs["ssh"]), "pdsh_s": min(runs["pdsh"]),
               "tpudist_start_s": min(runs["start"]), "tpudist_stop_s": min(runs["stop"]),
               "tpudist_fail_fast_s": min(runs["fail"]), "launcher_cpu_s": min(runs["cpu"]),
               "ssh_machine_cpu_s": min(runs["ssh_cpu"]), "start_machine_cpu_s": min(runs["start_cpu"]),
               "processes_left": max(runs["left"]), "clean_login": sshd.clean_login, "runs": runs}
        row["start_vs_ssh"] = row["tpudist_start_s"] / row["ssh_fanout_s"]
        results.append(row)
        print(f"measured {n} hosts: {row['tpudist_start_s']:.2f} s start vs {row['ssh_fanout_s']:.2f} s ssh",
              file=sys.stderr)
    header = (f"{'hosts':>5}  {'ssh fan-out':>11}  {'pdsh':>6}  {'tpudist start':>13}  {'x ssh':>5}  "
              f"{'stop (^C)':>9}  {'fail-fast':>9}  {'launcher cpu':>12}  {'cpu: ssh':>8}  {'tpudist':>7}  {'left':>4}")
    print(header)
    for r in results:
        print(f"{r['hosts']:>5}  {r['ssh_fanout_s']:>10.2f}s  {r['pdsh_s']:>5.2f}s  {r['tpudist_start_s']:>12.2f}s  "
              f"{r['start_vs_ssh']:>5.2f}  {r['tpudist_stop_s']:>8.2f}s  {r['tpudist_fail_fast_s']:>8.2f}s  "
              f"{r['launcher_cpu_s']:>11.2f}s  {r['ssh_machine_cpu_s']:>7.2f}s  {r['start_machine_cpu_s']:>6.2f}s  "
              f"{r['processes_left']:>4}")
    doc = {"benchmark": "launch", "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "results": results}
    print(json.dumps(doc))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
