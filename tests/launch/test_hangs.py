"""Hangs explained: --hang-timeout, SIGQUIT, and the stacks of ranks that crash or are SIGKILLed.

Each hang test runs a real 2-process --local job (real XLA, gloo collectives): both ranks meet in one
all_reduce, then rank 1 gets stuck outside any collective (asleep, spinning in Python, or deadlocked
on two locks with another thread) while rank 0 waits in the next all_reduce. The launcher must name
rank 1 and its innermost frame (file:line in function) in the stacks table, end the job with exit
status 124 within --hang-timeout plus a few seconds, and leave nothing running.
"""

from __future__ import annotations

import re
import signal
import textwrap
import time

import pytest
from launchutil import launch, start_launcher, wait_lines

pytestmark = pytest.mark.slow

HANG_S = 4
# Until both ranks are ready, a thread prints a line every 0.5 s: start-up (importing JAX, joining,
# the first compile) is progress, however slow a busy machine makes it; only the stuck phase is silent.
TICK = textwrap.dedent("""
    import os, sys, threading, time
    ready = threading.Event()
    def tick():
        while not ready.wait(0.5):
            print("starting", flush=True)
    threading.Thread(target=tick, daemon=True).start()
""")
JOB = TICK + textwrap.dedent("""

    import numpy as np
    import tpudist

    job = tpudist.init()
    tpudist.all_reduce(np.ones(4, np.float32))
    ready.set()
    print(f"rank {job.rank} ready", flush=True)

    def stuck_sleep():
        time.sleep(3600)  # LINE:sleep

    def spin():
        x = 0
        # one line: a stack sample may land on the loop's jump back as well as on its body
        while True: x += 1  # LINE:spin

    def deadlock():
        a, b = threading.Lock(), threading.Lock()
        def other():
            with b:
                time.sleep(0.2)
                with a:  # LINE:other
                    pass
        with a:
            threading.Thread(target=other, daemon=True).start()
            time.sleep(0.2)
            with b:  # LINE:deadlock
                pass

    if job.rank == 1:
        {"sleep": stuck_sleep, "spin": spin, "deadlock": deadlock}[sys.argv[1]]()
    tpudist.all_reduce(np.ones(4, np.float32))  # LINE:wait
    print(f"rank {job.rank} done", flush=True)
""")


def _line(tag: str) -> int:
    return next(i for i, text in enumerate(JOB.splitlines(), 1) if text.endswith(f"# LINE:{tag}"))


def _job(tmp_path) -> str:
    path = tmp_path / "hang_job.py"
    path.write_text(JOB)
    return str(path)


def _flags(*extra: str) -> list[str]:
    # The waiting rank's collective must not time out first: that is a failure of its own.
    return ["--nproc-per-host", "2", "--cpu-devices", "1", "--stop-grace", "1",
            "--env", "TPUDIST_COLLECTIVE_TIMEOUT=120", *extra]


def _row(err: str, rank: int) -> str:
    table = err[err.index("rank  host"):]
    return next(line for line in table.splitlines() if re.match(rf"{rank}\s", line))


@pytest.mark.parametrize("how, function", [("sleep", "stuck_sleep"), ("spin", "spin"), ("deadlock", "deadlock")])
def test_stuck_rank_is_named_with_its_frame_and_the_job_ends(tmp_path, marker, no_leftovers, how, function):
    proc = start_launcher("--local", *_flags("--hang-timeout", str(HANG_S)), "--", "python", _job(tmp_path),
                          how, marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=120)
        t0 = time.monotonic()
        code = proc.wait(timeout=HANG_S + 30)
        took = time.monotonic() - t0
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    print(err)
    assert code == 124, err
    assert "tpudist: the job hung (exit status 124); every process was stopped" in err, err
    frame = f"hang_job.py:{_line(how)} in {function}"
    assert frame in _row(err, 1), err
    assert re.search(r"in all_reduce\s+.*hang_job\.py:%d in <module>" % _line("wait"), _row(err, 0)), err
    assert re.search(rf"root cause: no rank made progress for {HANG_S} s \(--hang-timeout\); rank 1 on "
                     rf"localhost \(worker 0, pid \d+\) is at {frame}, outside any collective, while "
                     r"rank 0 waits in all_reduce", err), err
    if how == "deadlock":  # the other thread, holding the lock the main thread waits for
        assert f'hang_job.py", line {_line("other")} in other' in err, err
    assert took < HANG_S + 2 + 8, took  # heartbeat (2 s), the dumps, the stop (1 s grace, SIGKILL)


def test_hang_action_report_prints_the_table_and_the_job_runs_on(tmp_path, marker, no_leftovers):
    # Rank 1 naps 7 s between two collectives, longer than --hang-timeout 3, then both go on.
    job = _job(tmp_path)
    source = (tmp_path / "hang_job.py").read_text().replace(
        '{"sleep": stuck_sleep, "spin": spin, "deadlock": deadlock}[sys.argv[1]]()', "time.sleep(7)  # LINE:nap")
    (tmp_path / "hang_job.py").write_text(source)
    r = launch("--local", *_flags("--hang-timeout", "3", "--hang-action", "report"), "--", "python", job,
               "nap", marker, timeout=120)
    err = r.stderr.decode()
    print(err)
    assert r.returncode == 0, err
    assert b"rank 1 done" in r.stdout and b"rank 0 done" in r.stdout
    nap = next(i for i, text in enumerate(source.splitlines(), 1) if text.endswith("# LINE:nap"))
    assert "tpudist: every rank's Python stacks (no rank made progress for 3 s (--hang-timeout)); " \
           "the job runs on" in err, err
    assert re.search(rf"\n1\s+localhost\s+sleeping\s+hang_job\.py:{nap} in <module>", err), err
    assert "likely culprit: no rank made progress for 3 s" in err and "root cause" not in err, err


def test_sigquit_prints_every_ranks_stacks_and_the_job_runs_on(tmp_path, marker, no_leftovers):
    proc = start_launcher("--local", *_flags(), "--", "python", _job(tmp_path), "sleep", marker)
    try:
        wait_lines(proc, 2, b"ready", timeout=120)
        proc.send_signal(signal.SIGQUIT)
        time.sleep(3)
        assert proc.poll() is None, "SIGQUIT must not end the job"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    print(err)
    assert "tpudist: every rank's Python stacks (asked for with SIGQUIT); the job runs on" in err, err
    assert f"hang_job.py:{_line('sleep')} in stuck_sleep" in _row(err, 1), err
    assert "likely culprit: asked for with SIGQUIT; rank 1 on localhost" in err, err


def test_hang_over_ssh_is_explained(sshd, tmp_path, marker, no_leftovers):
    r = launch(*sshd.launcher_flags(2), *_flags("--hang-timeout", str(HANG_S))[2:], "--nproc-per-host", "1",
               "--", "python", _job(tmp_path), "sleep", marker, timeout=150)
    err = r.stderr.decode()
    print(err)
    assert r.returncode == 124, err
    assert re.search(rf"1\s+127\.0\.0\.3\s+sleeping\s+hang_job\.py:{_line('sleep')} in stuck_sleep", err), err
    assert "rank 1 on 127.0.0.3 (worker 1" in err, err


def test_sigkilled_rank_gets_a_memory_hint(marker, no_leftovers):
    code = "import os, sys; sys.exit(0) if os.environ['RANK'] == '0' else os.kill(os.getpid(), 9)"
    r = launch("--local", "--nproc-per-host", "2", "--", "python", "-c", code, marker, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 137, err
    assert "root cause (first observed failure): rank 1 on localhost (worker 0): SIGKILL" in err, err
    assert "hint: SIGKILL came from outside the job: on Linux most often the kernel's OOM killer" in err, err
    assert "dmesg -T | grep -i oom" in err, err


def test_segfaulting_rank_shows_its_python_stack(marker, no_leftovers):
    code = textwrap.dedent("""
        import ctypes, tpudist
        tpudist.init()
        def crash():
            ctypes.string_at(0)
        crash()
    """)
    r = launch("--local", "--nproc-per-host", "1", "--", "python", "-c", code, marker, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 139, err
    root = err[err.index("root cause"):]
    assert "Fatal Python error: Segmentation fault" in root, err
    assert re.search(r'File "<string>", line 5 in crash\n.*File "<string>", line 6 in <module>', root, re.S), err


def test_compiled_steps_are_progress(tmp_path, marker, no_leftovers):
    # Both ranks run a compiled step for twice --hang-timeout, printing nothing: not a hang.
    source = JOB.replace('    {"sleep": stuck_sleep, "spin": spin, "deadlock": deadlock}[sys.argv[1]]()\n', "").replace(
        "if job.rank == 1:\n", textwrap.dedent(f"""
            import jax.numpy as jnp
            from jax.sharding import PartitionSpec as P
            mesh = tpudist.mesh.make_mesh({{"data": -1}})
            step = tpudist.compile(lambda x: x + 1, mesh=mesh, in_specs=(P("data"),))
            x, end = jnp.zeros(4), time.monotonic() + {2 * HANG_S}
            while time.monotonic() < end:
                x = step(x)
                x.block_until_ready()
                time.sleep(0.05)
        """))
    path = tmp_path / "steps_job.py"
    path.write_text(source)
    r = launch("--local", *_flags("--hang-timeout", str(HANG_S)), "--", "python", str(path), marker, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert b"rank 0 done" in r.stdout and b"rank 1 done" in r.stdout
    assert "no rank made progress" not in err, err


# A program that never imports tpudist: torchrun's contract (RANK, MASTER_ADDR, ...) and
# torch.distributed over gloo, started through a shell wrapper (its Python is the shell's child).
# The launcher's startup hook gives it a stack dumper; the user's own sitecustomize still runs.
PLAIN_JOB = TICK + textwrap.dedent("""

    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    ready.set()
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        time.sleep(3600)  # LINE:sleep
    dist.all_reduce(torch.ones(4))  # LINE:wait
""")


def test_a_program_without_tpudist_gets_its_hang_explained(tmp_path, marker, no_leftovers):
    job = tmp_path / "plain_job.py"
    job.write_text(PLAIN_JOB)
    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("print('own sitecustomize ran', flush=True)\n")
    line = {tag: next(i for i, text in enumerate(PLAIN_JOB.splitlines(), 1) if text.endswith(f"# LINE:{tag}"))
            for tag in ("sleep", "wait")}
    r = launch("--local", *_flags("--hang-timeout", str(HANG_S), "--env", f"PYTHONPATH={own}"), "--",
               "sh", "-c", 'python "$@"; exit $?', "sh", str(job), marker, timeout=150)
    err = r.stderr.decode()
    print(err)
    assert r.returncode == 124, err
    assert r.stdout.count(b"own sitecustomize ran") == 2, r.stdout
    assert f"plain_job.py:{line['sleep']} in <module>" in _row(err, 1), err
    assert re.search(r"in torch\.distributed\.all_reduce\s+.*\(from plain_job\.py:%d in <module>\)" % line["wait"],
                     _row(err, 0)), err
    assert re.search(r"root cause: no rank made progress for \d+ s \(--hang-timeout\); rank 1 on localhost "
                     r"\(worker 0, pid \d+\) is at plain_job\.py:%d in <module>, outside any collective, while "
                     r"rank 0 waits in torch\.distributed\.all_reduce" % line["sleep"], err), err


# A plain JAX program (jax.distributed.initialize() with no arguments reads the variables the
# launcher sets): rank 1 never joins, rank 0 waits in initialize.
JAX_JOB = TICK + textwrap.dedent("""

    import jax
    ready.set()
    if os.environ["RANK"] == "1":
        time.sleep(3600)  # LINE:sleep
    jax.distributed.initialize()  # LINE:wait
""")


def test_a_plain_jax_program_waiting_to_join_is_named(tmp_path, marker, no_leftovers):
    job = tmp_path / "jax_job.py"
    job.write_text(JAX_JOB)
    line = {tag: next(i for i, text in enumerate(JAX_JOB.splitlines(), 1) if text.endswith(f"# LINE:{tag}"))
            for tag in ("sleep", "wait")}
    r = launch("--local", *_flags("--hang-timeout", str(HANG_S)), "--", "python", str(job), marker, timeout=150)
    err = r.stderr.decode()
    print(err)
    assert r.returncode == 124, err
    assert f"jax_job.py:{line['sleep']} in <module>" in _row(err, 1), err
    assert re.search(r"in jax\.distributed\.initialize\s+.*\(from jax_job\.py:%d in <module>\)" % line["wait"],
                     _row(err, 0)), err
