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
so), the same for every tool. The tools take turns run by run and each number is the median of
--repeat runs (scripts/_bench.py), since the machine may be shared. Prints a table, writes JSON
(bench-results/launch.json by default) and a PNG beside it.

    .venv/bin/python scripts/bench_launch.py --hosts 1,8,32,64 --repeat 2 --json bench.json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import signal
import statistics
import subprocess
import sys
import time
import uuid

import _bench
import _plots
from _sshd import LoopbackSshd

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


COLUMNS = [("hosts", "hosts"), ("ssh fan-out s", "ssh_fanout_s", ".2f"), ("pdsh s", "pdsh_s", ".2f"),
           ("tpudist start s", "tpudist_start_s", ".2f"), ("x ssh", "start_vs_ssh", ".2f"),
           ("stop (^C) s", "tpudist_stop_s", ".2f"), ("fail-fast s", "tpudist_fail_fast_s", ".2f"),
           ("launcher cpu s", "launcher_cpu_s", ".2f"), ("cpu: ssh s", "ssh_machine_cpu_s", ".2f"),
           ("tpudist s", "start_machine_cpu_s", ".2f"), ("left", "processes_left")]


def measure(sshd: LoopbackSshd, repeat: int, timeout: float) -> dict:
    """One row: the anchor (ssh fan-out), pdsh and tpudist's two jobs, interleaved run by run;
    medians over the runs (tpudist's start over both of its jobs), the most processes left."""
    ssh_fanout(sshd, timeout)  # warm-up: page cache, sshd's first forks
    got = _bench.alternate({"ssh": lambda: ssh_fanout(sshd, timeout), "pdsh": lambda: pdsh(sshd, timeout),
                            "stop": lambda: tpudist(sshd, timeout, "stop"),
                            "fail": lambda: tpudist(sshd, timeout, "fail")}, repeat)
    jobs = got["stop"] + got["fail"]
    runs = {"ssh": [e for e, _ in got["ssh"]], "ssh_cpu": [c for _, c in got["ssh"]], "pdsh": got["pdsh"],
            "start": [j["start"] for j in jobs], "start_cpu": [j["start_machine_cpu"] for j in jobs],
            "stop": [j["end"] for j in got["stop"]], "fail": [j["end"] for j in got["fail"]],
            "cpu": [j["launcher_cpu"] for j in jobs], "left": [j["left"] for j in jobs]}
    m = {k: statistics.median(v) for k, v in runs.items()}
    row = {"hosts": len(sshd.addresses), "ssh_fanout_s": m["ssh"], "pdsh_s": m["pdsh"],
           "tpudist_start_s": m["start"], "tpudist_stop_s": m["stop"], "tpudist_fail_fast_s": m["fail"],
           "launcher_cpu_s": m["cpu"], "ssh_machine_cpu_s": m["ssh_cpu"], "start_machine_cpu_s": m["start_cpu"],
           "processes_left": max(runs["left"]), "clean_login": sshd.clean_login, "runs": runs}
    row["start_vs_ssh"] = row["tpudist_start_s"] / row["ssh_fanout_s"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,8,32,64", help="host counts to measure")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement, interleaved; the median is reported")
    ap.add_argument("--timeout", type=float, default=180.0)
    _bench.add_output_args(ap, "launch")
    ap.add_argument("--machine-bashrc", action="store_true",
                    help="keep this machine's ~/.bashrc in every SSH session (default: an empty one)")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.hosts.split(",")]:
        with LoopbackSshd(n, clean_login=not args.machine_bashrc) as sshd:
            results.append(measure(sshd, args.repeat, args.timeout))
        print(f"measured {n} hosts: {results[-1]['tpudist_start_s']:.2f} s start vs "
              f"{results[-1]['ssh_fanout_s']:.2f} s ssh", file=sys.stderr)
    print(_bench.table(results, COLUMNS, f"launch over SSH to loopback hosts, median of {args.repeat} runs"))
    out = _bench.Output.from_args(args)
    out.write({"benchmark": "launch", "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "results": results},
              announce=True)
    out.picture(lambda png: _plots.time_bars(
        results, png, keys=["ssh_fanout_s", "pdsh_s", "tpudist_start_s", "tpudist_stop_s", "tpudist_fail_fast_s"],
        labels=["ssh fan-out", "pdsh", "tpudist start", "stop (^C)", "fail-fast"],
        group=lambda r: f"{r['hosts']} hosts", ylabel="seconds", title="tpudist launch vs ssh fan-out"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
