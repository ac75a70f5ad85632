#!/usr/bin/env python3
"""Benchmark: how long `python -m tpudist.xla_dist` takes to start and to stop a job over SSH.

For 1, 8, 32 and 64 loopback hosts (127.0.0.2, 127.0.0.3, ... served by a real sshd, see
scripts/_sshd.py) it measures, in the same run:

  ssh fan-out   every host at once with the OpenSSH client: `ssh host true` (the anchor)
  pdsh          `pdsh -R ssh -w <all hosts> true`
  tpudist start launcher start until every process has printed its first line
  tpudist stop  SIGINT to the launcher until it has exited, every process stopped on every host

One process per host runs `sh -c 'echo ready; exec sleep 600'`. All hosts share this machine's
cores, so per-host work (sshd, the agent) adds up here where a real pod runs it in parallel.
Each number is the best of --repeat runs (the machine may be shared). Prints a table and JSON.

    .venv/bin/python scripts/bench_launch.py --hosts 1,8,32,64 --repeat 2 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _sshd import LoopbackSshd  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ssh_fanout(sshd: LoopbackSshd, timeout: float) -> float:
    t0 = time.monotonic()
    procs = [subprocess.Popen(["ssh", *sshd.ssh_options(), a, "true"]) for a in sshd.addresses]
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"ssh fan-out failed: exit codes {codes}")
    return time.monotonic() - t0


def pdsh(sshd: LoopbackSshd, timeout: float) -> float:
    env = {**os.environ, "PDSH_SSH_ARGS": " ".join(sshd.ssh_options()) + " %h"}
    t0 = time.monotonic()
    subprocess.run(["pdsh", "-R", "ssh", "-f", str(len(sshd.addresses)), "-w", ",".join(sshd.addresses),
                    "true"], env=env, check=True, timeout=timeout)
    return time.monotonic() - t0


def tpudist(sshd: LoopbackSshd, timeout: float) -> tuple[float, float, int]:
    """(start seconds, stop seconds, processes left running afterwards)."""
    marker = f"tpudist-bench-{uuid.uuid4().hex[:8]}"
    n = len(sshd.addresses)
    cmd = [sys.executable, "-m", "tpudist.xla_dist", *sshd.launcher_flags(), "--fanout", str(n),
           "--", "sh", "-c", "echo ready; exec sleep 600", marker]
    t0 = time.monotonic()
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
        started = time.monotonic() - t0
        t1 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=timeout)
        stopped = time.monotonic() - t1
        if code != 130:
            raise RuntimeError(f"launcher exited {code} after SIGINT, not 130")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # agents end their processes on their own after the launcher; give them a moment
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return started, stopped, len(left)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,8,32,64", help="host counts to measure")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is reported")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.hosts.split(",")]:
        with LoopbackSshd(n) as sshd:
            ssh_fanout(sshd, args.timeout)  # warm-up: page cache, sshd's first forks
            runs = {"ssh": [], "pdsh": [], "start": [], "stop": [], "left": []}
            for _ in range(args.repeat):
                runs["ssh"].append(ssh_fanout(sshd, args.timeout))
                runs["pdsh"].append(pdsh(sshd, args.timeout))
                start, stop, left = tpudist(sshd, args.timeout)
                runs["start"].append(start)
                runs["stop"].append(stop)
                runs["left"].append(left)
        row = {"hosts": n, "ssh_fanout_s": min(runs["ssh"]), "pdsh_s": min(runs["pdsh"]),
               "tpudist_start_s": min(runs["start"]), "tpudist_stop_s": min(runs["stop"]),
               "processes_left": max(runs["left"]), "runs": runs}
        row["start_vs_ssh"] = row["tpudist_start_s"] / row["ssh_fanout_s"]
        results.append(row)
        print(f"measured {n} hosts: {row['tpudist_start_s']:.2f} s start vs {row['ssh_fanout_s']:.2f} s ssh",
              file=sys.stderr)
    header = f"{'hosts':>5}  {'ssh fan-out':>11}  {'pdsh':>6}  {'tpudist start':>13}  {'x ssh':>6}  " \
             f"{'tpudist stop':>12}  {'left':>4}"
    print(header)
    for r in results:
        print(f"{r['hosts']:>5}  {r['ssh_fanout_s']:>10.2f}s  {r['pdsh_s']:>5.2f}s  {r['tpudist_start_s']:>12.2f}s  "
              f"{r['start_vs_ssh']:>6.2f}  {r['tpudist_stop_s']:>11.2f}s  {r['processes_left']:>4}")
    doc = {"benchmark": "launch", "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "results": results}
    print(json.dumps(doc))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
