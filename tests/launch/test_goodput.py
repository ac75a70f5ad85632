"""The launcher's goodput over a job's attempts, from fit's reports on rank 0 (the end-to-end run
under a restart: tests/compile/test_resume.py)."""

from __future__ import annotations

import json

from tpudist import contract
from tpudist.launch._goodput import JobGoodput


def _report(**fields) -> bytes:
    return (contract.GOODPUT_REPORT + json.dumps(fields)).encode()


def test_steps_run_again_after_a_restart_are_not_progress():
    goodput = JobGoodput()
    # attempt 0: 6 s of stepping for steps 0..20; a rank died after step 20, the checkpoint was at 16
    assert goodput.read(_report(attempt=0, wall_s=9.0, compile_s=1.0, data_s=1.0, checkpoint_s=1.0,
                                first_step=0, global_step=20))
    # an earlier report of attempt 1 is replaced by its latest
    assert goodput.read(_report(attempt=1, wall_s=3.0, compile_s=1.0, data_s=0.0, checkpoint_s=0.0,
                                first_step=16, global_step=24))
    assert goodput.read(_report(attempt=1, wall_s=8.0, compile_s=1.0, data_s=0.0, checkpoint_s=1.0,
                                first_step=16, global_step=48))
    # stepping: attempt 0's 6 s less its last 4 of 20 steps (1.2 s), and attempt 1's 6 s
    line = goodput.summary(wall_s=25.0)
    assert line == ("tpudist: goodput 43% over the job (2 attempts, 25.0 s): stepping 10.8 s; compile 2.0 s, "
                    "data 1.0 s, checkpoints 2.0 s, steps run again after a restart 1.2 s, startup, restarts "
                    "and the rest 8.0 s")


def test_other_lines_are_left_and_no_report_means_no_summary():
    goodput = JobGoodput()
    assert not goodput.read(b"epoch 1/2: loss 0.5")
    assert not goodput.read(contract.GOODPUT_REPORT.encode() + b"not json")
    assert goodput.summary(wall_s=10.0) is None
