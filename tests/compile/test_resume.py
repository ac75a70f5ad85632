"""`fit` resumes exactly: a job killed mid-epoch and restarted by the launcher, or stopped by
SIGTERM and started again, ends bit-identical to one that ran straight through (2 processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parent / "resume_job.py"
REPO = Path(__file__).resolve().parents[2]


def launch(*args: str, restarts: int = 0, timeout: float = 240, sharding: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2",
                           "--env", f"RESUME_SHARDING={sharding}",
                           "--max-restarts", str(restarts), "--", sys.executable, str(JOB), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> str:
    """The uninterrupted run's final hash."""
    tmp = tmp_path_factory.mktemp("straight")
    done = launch(str(tmp / "ckpt"), "-1", str(tmp / "out"), "3")
    assert done.returncode == 0, done.stdout + done.stderr
    return (tmp / "out").read_text()


def test_a_rank_killed_mid_epoch_restarts_and_ends_bit_identical(straight, tmp_path):
    start = time.monotonic()
    done = launch(str(tmp_path / "ckpt"), "40", str(tmp_path / "out"), "3", restarts=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 1 failed; restarting" in done.stderr and "rank 1 on localhost (worker 0): SIGKILL" in done.stderr
    assert (tmp_path / "out").read_text() == straight   # parameters, optimizer state and LR: bit for bit
    seconds = time.monotonic() - start
    print(f"kill and resume: {seconds:.1f} s")
    # the launcher's goodput over both attempts, from fit's reports (tests/launch/test_goodput.py)
    import re
    found = re.search(r"tpudist: goodput (\d+)% over the job \(2 attempts, ([\d.]+) s\): stepping ([\d.]+) s",
                      done.stderr)
    assert found, done.stderr
    percent, job, stepping = int(found[1]), float(found[2]), float(found[3])
    assert 0 < stepping < job <= seconds and abs(percent - 100 * stepping / job) <= 1, found[0]


def test_sigterm_saves_at_an_agreed_step_and_a_new_job_resumes(straight, tmp_path):
    from tpudist import checkpoint
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen([sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2",
                            "--stop-grace", "20", "--", sys.executable, str(JOB), str(ckpt), "-1",
                            str(tmp_path / "out"), "3"], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 180
    for line in job.stdout:  # stop it once the first epoch is done: mid-run
        lines.append(line)
        if "epoch 1/3" in line or time.monotonic() > deadline:
            break
    stopped = time.monotonic()
    job.send_signal(signal.SIGINT)  # Ctrl-C: the launcher sends SIGTERM to every process
    out, _ = job.communicate(timeout=60)
    output = "".join(lines) + out
    assert job.returncode == 130, output
    assert "fit: stopped by SIGTERM after step" in output, output
    assert "exit 143 (stopped)" in output, output  # both processes ended by themselves, after saving
    saved = checkpoint.latest_step(ckpt)
    assert saved is not None and 16 <= saved < 48, (saved, output)
    print(f"stop to exit: {time.monotonic() - stopped:.1f} s, saved at step {saved}")
    done = launch(str(ckpt), "-1", str(tmp_path / "out"), "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out").read_text() == straight


def test_a_sharded_run_killed_mid_epoch_restarts_and_ends_bit_identical(tmp_path):
    """The same under FSDP: each process saves and restores only its own shards."""
    straight = launch(str(tmp_path / "ckpt0"), "-1", str(tmp_path / "out0"), "2", sharding="fsdp")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    done = launch(str(tmp_path / "ckpt"), "24", str(tmp_path / "out"), "2", restarts=1, sharding="fsdp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 1 failed; restarting" in done.stderr
    assert (tmp_path / "out").read_text() == (tmp_path / "out0").read_text()


def test_a_checkpoint_resumed_by_other_processes_keeps_its_global_batch_when_it_splits():
    from tpudist.compile._torch.train._resume import Layout, elastic_accumulation

    assert elastic_accumulation(Layout(2, 3), 2, 3) == (3, "")                 # the same job
    k, said = elastic_accumulation(Layout(4, 1), 2, 1)                         # a host of two dropped
    assert k == 2 and "every step still trains on 4 loader batches (the same global batch)" in said
    k, said = elastic_accumulation(Layout(1, 2), 2, 1)                         # --rejoin: back to two
    assert k == 1 and "the same global batch" in said
    k, said = elastic_accumulation(Layout(4, 1), 3, 1)                         # 4 batches over 3
    assert k == 1 and "warning" in said and "a step now trains on 3 batches (the global batch changes" in said
