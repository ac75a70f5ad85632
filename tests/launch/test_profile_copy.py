"""`--profile DIR --profile-steps A:B` (issue 20): every process gets TPUDIST_PROFILE_DIR and
TPUDIST_PROFILE_STEPS, and when the job ends every host's traces are copied back into DIR (over
the hosts' SSH connections; a local copy for --local). Writing real traces is `fit`'s part; here the
program writes a stand-in trace file itself where a trace would go."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from launchutil import launch

from tpudist import contract
from tpudist.launch.args import parse_args

STAND_IN_TRACE = textwrap.dedent("""
    import json, os
    rank = os.environ["RANK"]
    out = os.path.join(os.environ["TPUDIST_PROFILE_DIR"], "rank" + rank, "plugins", "profile", "run1")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host.trace.json"), "w") as f:   # a stand-in for a trace of steps A..B-1
        json.dump({"rank": rank, "steps": os.environ["TPUDIST_PROFILE_STEPS"], "host": os.environ["TPUDIST_HOST"],
                   "dir": os.environ["TPUDIST_PROFILE_DIR"]}, f)
""")


def _check_traces(local_dir, ranks: int, steps: str) -> list[str]:
    remote_dirs = []
    for rank in range(ranks):
        trace = local_dir / f"rank{rank}" / "plugins" / "profile" / "run1" / "host.trace.json"
        got = json.loads(trace.read_text())
        assert (got["rank"], got["steps"]) == (str(rank), steps)
        remote_dirs.append(got["dir"])
    return remote_dirs


@pytest.mark.slow
def test_traces_of_every_rank_of_a_two_host_ssh_job_arrive_under_the_local_dir(sshd, tmp_path):
    script = tmp_path / "trace.py"
    script.write_text(STAND_IN_TRACE)
    local_dir = tmp_path / "profiles"
    r = launch(*sshd.launcher_flags(2), "--nproc-per-host", "2", "--profile", str(local_dir),
               "--profile-steps", "10:13", "--", "python", str(script), timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    remote_dirs = _check_traces(local_dir, 4, "10:13")
    assert len(set(remote_dirs)) == 2  # one directory per host, job-specific
    assert all(d.startswith("/tmp/tpudist-profile-") for d in remote_dirs)
    assert not any(os.path.exists(d) for d in remote_dirs)  # removed from the hosts once copied
    assert f"traces of 4 ranks (4 files" in err and f"from 2 hosts are in {local_dir}" in err
    assert f"tensorboard --logdir {local_dir}" in err and "ui.perfetto.dev" in err


def test_traces_of_a_local_job_are_copied_and_the_default_steps_are_set(tmp_path):
    script = tmp_path / "trace.py"
    script.write_text(STAND_IN_TRACE)
    local_dir = tmp_path / "profiles"
    r = launch("--nproc-per-host", "2", "--profile", str(local_dir), "--", "python", str(script))
    assert r.returncode == 0, r.stderr.decode()
    remote_dirs = _check_traces(local_dir, 2, "2:5")
    assert not any(os.path.exists(d) for d in remote_dirs)
    assert f"tensorboard --logdir {local_dir}" in r.stderr.decode()


def test_a_job_that_writes_no_trace_says_so(tmp_path):
    r = launch("--profile", str(tmp_path / "p"), "--", "python", "-c", "pass")
    assert r.returncode == 0 and b"no host wrote a trace" in r.stderr


def test_dry_run_shows_the_profile_variables(tmp_path):
    r = launch("--hosts", "a,b", "--profile", str(tmp_path), "--profile-steps", "3:4", "--dry-run", "--", "true")
    assert r.returncode == 0, r.stderr.decode()
    procs = json.loads(r.stdout)["processes"]
    dirs = [p["env"][contract.PROFILE_DIR] for p in procs]
    assert len(set(dirs)) == 2 and all(p["env"][contract.PROFILE_STEPS] == "3:4" for p in procs)
    assert not any(contract.PROFILE_DIR in p["env"] for p in json.loads(
        launch("--dry-run", "--", "true").stdout)["processes"])


@pytest.mark.parametrize("flags, message", [
    (["--profile-steps", "1:2"], "--profile-steps 1:2 needs --profile DIR"),
    (["--profile", "p", "--profile-steps", "5:3"], "--profile-steps 5:3 must be A:B with 0 <= A < B"),
    (["--profile", "p", "--profile-steps", "five"], "--profile-steps 'five' must be A:B"),
    (["--env", "TPUDIST_PROFILE_DIR=x"], "TPUDIST_PROFILE_DIR is set by the launcher"),
])
def test_bad_profile_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*flags, "--", "true"])
