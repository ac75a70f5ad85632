"""Leaving a job (tpudist/_exit.py): what SIGTERM does to a process that called `tpudist.init()`.

Each case is a real 2-process job on this machine's CPU mesh, started by the launcher; one rank
sends SIGTERM to itself once both have joined. tests/launch/test_chaos.py has the jobs the
launcher stops, and the collective that times out.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]

JOINED = textwrap.dedent("""
    import atexit, os, signal, sys, time
    import numpy as np
    import tpudist
    {before_init}
    tpudist.init({init_args})
    rank = tpudist.process_index()
    atexit.register(lambda: print("atexit", rank, flush=True))
    tpudist.all_reduce(np.ones(2, np.float32))
""")


def _job(tmp_path, body: str, before_init: str = "", init_args: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOINED.format(before_init=before_init, init_args=init_args) + textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2",
                           "--cpu-devices", "1", "--", "python", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_sigterm_raises_system_exit_so_finally_and_atexit_run(tmp_path):
    r = _job(tmp_path, """
        try:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        finally:
            print("finally", rank, flush=True)
    """)
    assert r.returncode == 143, r.stderr[-3000:]
    assert re.search(r"localhost\s+0\s+1\s+exit 143\s+\S+\s+<- root cause", r.stderr), r.stderr[-3000:]
    assert re.search(r"localhost\s+0\s+0\s+exit 143 \(stopped\)", r.stderr), r.stderr[-3000:]
    for rank in (0, 1):
        assert f"finally {rank}" in r.stdout and f"atexit {rank}" in r.stdout, r.stdout


def test_a_sigterm_handler_set_before_init_is_kept(tmp_path):
    # JAX's preemption notifier replaces it while joining; init() puts it back.
    own = ("signal.signal(signal.SIGTERM, lambda *a: (print('own handler', flush=True), os._exit(7)))")
    r = _job(tmp_path, """
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
    """, before_init=own)
    assert r.returncode == 7, r.stderr[-3000:]
    assert "own handler" in r.stdout and "SIGTERM caught" not in r.stderr


def test_handle_sigterm_false_keeps_jaxs_preemption_notice(tmp_path):
    r = _job(tmp_path, """
        from jax.experimental import multihost_utils
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        for step in range(3000):
            if multihost_utils.reached_preemption_sync_point(step):
                print("checkpoint at step", step, flush=True)
                break
            time.sleep(0.01)
    """, init_args="handle_sigterm=False")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"\[w0 r(\d) localhost\] checkpoint at step (\d+)", r.stdout)
    assert sorted(rank for rank, _ in steps) == ["0", "1"] and len({s for _, s in steps}) == 1, r.stdout
