"""--min-hosts: a host lost for good mid-training, and the job goes on over the others.

Real sshd, one per loopback host (so one host's sshd can be killed for good), real processes and
`tpudist.fit` with checkpoints. The elastic run's parameters and per-epoch losses are checked
against eager torch training the same model on the same batches, uninterrupted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from launchutil import environ_of, job_pids, launch, parent_of, start_launcher, wait_lines, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _sshd import LoopbackSshd  # noqa: E402

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent / "elastic_job.py"


@pytest.fixture
def two_sshds():
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed (apt-get install openssh-server openssh-client)")
    server = LoopbackSshd(2, per_host=True).start()
    yield server
    server.stop()


def _eager_reference(batches_per_step: int, dtype: torch.dtype, epochs: int = 3):
    """The same training in eager torch, never interrupted: each step the mean loss over
    `batches_per_step` consecutive loader batches (what fit's global batch is)."""
    sys.path.insert(0, str(JOB.parent))
    import elastic_job as job

    model, opt = job.model_and_optimizer(dtype)
    loader = job.loader()
    losses = []
    for _ in range(epochs):
        batches = list(loader)
        steps = len(batches) // batches_per_step
        epoch = []
        for s in range(steps):
            group = batches[s * batches_per_step:(s + 1) * batches_per_step]
            x = torch.cat([b[0] for b in group]).to(dtype)
            y = torch.cat([b[1] for b in group])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            epoch.append(loss.item())
        losses.append(sum(epoch) / len(epoch))
    return dict(model.named_parameters()), losses


def test_a_host_lost_for_good_is_dropped_and_training_goes_on_with_the_same_global_batch(two_sshds, tmp_path, marker):
    out = tmp_path / "out.pt"
    proc = start_launcher(*two_sshds.launcher_flags(), "--max-restarts", "2", "--min-hosts", "1",
                          "--stop-grace", "2", "--env", f"ELASTIC_MARKER={marker}", "--",
                          sys.executable, str(JOB), str(tmp_path / "ckpt"), "7", str(out))
    try:
        # rank 1 stalls in step 4 of epoch 1, once step 2 or later is committed (saves go on in the background)
        assert wait_until(lambda: proc.poll() is not None or (Path(f"{out}.stalled").exists() and _committed(
            tmp_path / "ckpt") >= 2), timeout=120)
        assert proc.poll() is None, proc.stderr.read().decode()
        # host 127.0.0.3 goes away for good: its sshd stops listening, its session (with the agent
        # and rank 1) is killed
        t0 = time.monotonic()
        _take_host_away(two_sshds, marker)
        code = proc.wait(timeout=180)
        took = time.monotonic() - t0
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    assert code == 0, err[-4000:]
    assert "--min-hosts 1: dropped 127.0.0.3" in err and "attempt 2 runs on 1 of 2 hosts" in err, err[-3000:]
    assert "the job ended on 1 of 2 hosts; --min-hosts dropped 127.0.0.3" in err, err[-3000:]
    # the global batch kept: 2 loader batches per step, now both on the one process
    assert "1 processes now take 2 each, so every step still trains on 2 loader batches" in err, err[-3000:]
    got = torch.load(out)
    assert got["processes"] == 1
    # against eager torch in float64, within twice eager float32's own distance from it
    exact, exact_losses = _eager_reference(2, torch.float64)
    eager, eager_losses = _eager_reference(2, torch.float32)
    for name, want in exact.items():
        error = (got["params"][name].double() - want.detach()).norm()
        allowed = 2 * (eager[name].detach().double() - want.detach()).norm() + 1e-7 * want.norm()
        assert error <= allowed, (name, error.item(), allowed.item())
    # the loss curve: epochs 2 and 3 ran entirely after the host was dropped
    assert [h["epoch"] for h in got["history"]][-2:] == [2, 3]
    for record, want, f32 in zip(got["history"][-2:], exact_losses[1:], eager_losses[1:]):
        assert abs(record["loss"] - want) <= 2 * abs(f32 - want) + 1e-7, (record["loss"], want, f32)
    print(f"host lost -> job done on the survivor in {took:.1f} s; epoch losses {[h['loss'] for h in got['history']]}"
          f" vs uninterrupted float64 {exact_losses} (float32 {eager_losses})")
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes of the job outlived it"


def _committed(directory: Path) -> int:
    """The latest step orbax committed there (a step's directory appears when it is committed)."""
    steps = [int(p.name) for p in directory.glob("*") if p.name.isdigit()] if directory.exists() else []
    return max(steps, default=0)


# attempt 0 runs until the test takes host 2 away; attempt 1 (on host 1 alone) waits for the test
# to bring host 2 back, then asks for a restart (exit 42); attempt 2 ends
REJOIN = ("import os, sys, time, pathlib; a, d = os.environ['TPUDIST_RESTART'], pathlib.Path(sys.argv[1]); "
          "print('attempt', a, 'rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
          "os.environ['TPUDIST_HOST'], flush=True)\n"
          "if a == '0': time.sleep(600)\n"
          "if a == '1':\n"
          "    (d / 'attempt1').touch()\n"
          "    while not (d / 'revived').exists(): time.sleep(0.05)\n"
          "    sys.exit(42)\n")


def _take_host_away(server, marker: str) -> None:
    """Host 127.0.0.3 goes away: its sshd stops listening, its session (agent, processes) is killed."""
    rank1 = [p for p in job_pids(marker) if environ_of(p).get(b"RANK") == b"1"
             and environ_of(p).get(b"TPUDIST_HOST") == b"127.0.0.3"]
    assert rank1, "rank 1 is not running on 127.0.0.3"
    server.kill_host(1)
    os.kill(parent_of(parent_of(rank1[0])), signal.SIGKILL)


def test_rejoin_takes_a_dropped_host_back_at_the_next_restart(two_sshds, tmp_path, marker):
    proc = start_launcher(*two_sshds.launcher_flags(), "--max-restarts", "2", "--min-hosts", "1", "--rejoin",
                          "--stop-grace", "1", "--env", f"ELASTIC_MARKER={marker}", "--",
                          sys.executable, "-c", REJOIN, str(tmp_path))
    try:
        wait_lines(proc, 2, b"attempt 0 rank", timeout=60)
        _take_host_away(two_sshds, marker)
        assert wait_until(lambda: (tmp_path / "attempt1").exists() or proc.poll() is not None, timeout=60)
        two_sshds.revive_host(1)
        (tmp_path / "revived").touch()
        code = proc.wait(timeout=60)
        out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    finally:
        proc.kill()
    assert code == 0, err[-3000:]
    assert "attempt 1 rank 0 of 1 127.0.0.2" in out, out  # the survivor alone
    assert "attempt 2 rank 0 of 2 127.0.0.2" in out and "attempt 2 rank 1 of 2 127.0.0.3" in out, out
    assert "--min-hosts 1: dropped 127.0.0.3" in err and "--rejoin: 127.0.0.3 is back" in err, err
    assert "the job ended on" not in err, err  # it ended on every host
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes of the job outlived it"


def test_fewer_hosts_than_min_hosts_ends_the_job_naming_the_host(two_sshds, tmp_path, marker):
    proc = start_launcher(*two_sshds.launcher_flags(), "--max-restarts", "2", "--min-hosts", "2",
                          "--stop-grace", "1", "--env", f"ELASTIC_MARKER={marker}", "--",
                          sys.executable, "-c", REJOIN, str(tmp_path))
    try:
        wait_lines(proc, 2, b"attempt 0 rank", timeout=60)
        _take_host_away(two_sshds, marker)
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    assert code != 0
    assert "cannot restart the job: 1 of 2 hosts would be left, fewer than --min-hosts 2" in err, err
    assert "127.0.0.3" in err.split("cannot restart the job")[1] and "Connection refused" in err, err
    assert wait_until(lambda: not job_pids(marker), timeout=10), "processes of the job outlived it"


@pytest.mark.parametrize("flags, says", [
    (["--min-hosts", "1"], "--min-hosts 1 continues a job on fewer hosts at a restart, and no restart is "
                           "allowed: add --max-restarts N"),
    (["--max-restarts", "1", "--rejoin"], "--rejoin takes back hosts that --min-hosts dropped: add --min-hosts N"),
    (["--max-restarts", "1", "--min-hosts", "3"], "--min-hosts 3 is more than the job's 2 hosts"),
    (["--max-restarts", "1", "--min-hosts", "0"], "--min-hosts"),
])
def test_elastic_flags_are_checked_before_any_host_is_touched(flags, says):
    r = launch("--hosts", "127.0.0.2,127.0.0.3", *flags, "--dry-run", "--", "true", timeout=30)
    assert r.returncode == 2, r.stderr.decode()
    assert says in r.stderr.decode()


def test_min_hosts_refuses_to_drop_a_host_of_a_tpu_slice():
    # a TPU slice as the Cloud TPU API describes it (a stand-in: no TPU API here)
    from tpudist.launch._build import _check_elastic
    from tpudist.launch.clusters import Cluster, Host

    tpu = Cluster(source="tpu", hosts=(Host("10.0.0.2"), Host("10.0.0.3")), accelerator_type="v4-16")
    with pytest.raises(ValueError, match=r"cannot drop a host of a TPU slice \(v4-16 from tpu\)"):
        _check_elastic(1, tpu)
    _check_elastic(1, Cluster(source="hosts", hosts=(Host("10.0.0.2"), Host("10.0.0.3"))))
