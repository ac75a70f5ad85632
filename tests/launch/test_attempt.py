"""The job's state machine (tpudist/launch/attempt.py), fed by hand: no SSH, no processes, no clock.

What a user relies on: the root cause is the first failure the launcher observed (never a process it
was stopping itself), the launcher's exit status follows from the outcome, and --max-restarts runs a
failed job again exactly as often as asked, never an interrupted one, and under --restart-on infra
(the default) only after a failure of the machine, the network or someone outside the job, never after
the program's own error, saying so.
"""

from __future__ import annotations

import signal

import pytest

from tpudist.launch._report import ending_table, failure_table, restart_table
from tpudist.launch.attempt import LOST_EXIT, Attempt, Exit, Outcome, Phase, Restarts, failure_cause
from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.config import ProcessOptions
from tpudist.launch.plan import Ports, build_plan

TERM = Exit(code=0, signal=signal.SIGTERM)


def _plan(hosts: int = 2, nproc: int = 2):
    cluster = Cluster(source="hosts", hosts=tuple(Host(f"10.0.0.{2 + i}") for i in range(hosts)))
    return build_plan(ProcessOptions(command=("python", "train.py"), nproc_per_host=nproc), cluster,
                      Ports(1, 2), job_id="test")


def _running(number: int = 0, hosts: int = 2, nproc: int = 2) -> Attempt:
    attempt = Attempt(_plan(hosts, nproc), number=number)
    for s in attempt.states:
        attempt.started(number, s.plan.rank, pid=1000 + s.plan.rank)
    return attempt


def test_every_process_exiting_0_is_a_success_with_status_0():
    attempt = _running()
    assert attempt.phase is Phase.RUNNING and attempt.all_started() and attempt.running() == 4
    for rank in (3, 0, 2):
        attempt.exited(0, rank, Exit(code=0, run_s=1.0))
        assert attempt.phase is Phase.RUNNING
    attempt.exited(0, 1, Exit(code=0))
    assert attempt.phase is Phase.ENDED
    result = attempt.result()
    assert (result.outcome, result.exit_status, result.root_rank) == (Outcome.SUCCESS, 0, None)


def test_the_root_cause_is_the_first_observed_failure_not_the_lowest_rank():
    attempt = _running()
    attempt.exited(0, 3, Exit(code=7, tail=(b"Traceback (most recent call last):", b"ValueError: bad")))
    attempt.exited(0, 1, Exit(code=1))  # fails too, before the stop went out: still not the root
    assert attempt.root == 3 and attempt.phase is Phase.STOP
    attempt.begin_stop()
    assert attempt.phase is Phase.STOPPING
    attempt.exited(0, 0, TERM)
    attempt.exited(0, 2, TERM)
    assert attempt.phase is Phase.ENDED
    result = attempt.result()
    assert (result.outcome, result.root_rank, result.exit_status) == (Outcome.FAILURE, 3, 7)
    assert [s.describe() for s in result.states] == ["SIGTERM (stopped)", "exit 1", "SIGTERM (stopped)",
                                                      "exit 7"]
    table = failure_table(result)
    assert "rank 3 on 10.0.0.3 (worker 1): exit 7" in table and "  ValueError: bad" in table
    assert sum("<- root cause" in line for line in table.splitlines()) == 1


def test_processes_that_fail_while_being_stopped_are_never_the_root_cause():
    attempt = _running()
    attempt.exited(0, 2, Exit(code=0, signal=signal.SIGKILL))
    attempt.begin_stop()
    attempt.exited(0, 0, Exit(code=143))  # its own SIGTERM handler exited non-zero
    attempt.host_lost(0, "SSH connection lost")  # rank 1, still running, goes with its host
    attempt.exited(0, 3, Exit(code=0))
    result = attempt.result()
    assert result.root_rank == 2 and result.exit_status == 128 + signal.SIGKILL
    assert result.states[1].lost == "host agent gone: SSH connection lost"
    assert result.states[0].describe() == "exit 143 (stopped)"  # it ended by itself once asked to


def test_a_lost_host_fails_only_its_own_unfinished_processes_with_status_255():
    attempt = _running()
    attempt.exited(0, 2, Exit(code=0))  # worker 1's rank 2 had already finished
    attempt.host_lost(1, "control stream broken")
    assert attempt.root == 3 and attempt.states[2].exit_status() == 0
    attempt.begin_stop()
    attempt.exited(0, 0, TERM)
    attempt.exited(0, 1, TERM)
    result = attempt.result()
    assert result.exit_status == LOST_EXIT
    assert result.root.describe() == "lost (host agent gone: control stream broken)"


def test_reports_of_another_attempt_are_ignored():
    attempt = _running(number=1)
    attempt.exited(0, 0, Exit(code=3))  # a late exit from attempt 0
    attempt.started(0, 1, pid=1)
    attempt.exited(2, 1, Exit(code=3))
    assert attempt.phase is Phase.RUNNING and attempt.root is None
    assert attempt.states[1].pid == 1001


def test_an_interrupt_stops_the_job_and_wins_over_a_failure():
    attempt = _running()
    attempt.interrupt(signal.SIGINT)
    assert attempt.phase is Phase.STOP
    attempt.begin_stop()
    attempt.exited(0, 0, Exit(code=5))  # failed while being stopped
    for rank in (1, 2, 3):
        attempt.exited(0, rank, TERM)
    result = attempt.result()
    assert (result.outcome, result.exit_status, result.root_rank) == (Outcome.INTERRUPTED, 130, None)
    assert ending_table(result).startswith("tpudist: stopped by SIGINT; every process was stopped")

    failed = _running()
    failed.exited(0, 1, Exit(code=2))
    failed.begin_stop()
    failed.interrupt(signal.SIGTERM)  # Ctrl-C or SIGTERM during the stop still counts
    for rank in (0, 2, 3):
        failed.exited(0, rank, TERM)
    assert failed.result().outcome is Outcome.INTERRUPTED and failed.result().exit_status == 143


def test_processes_that_never_report_their_exit_are_given_up_on():
    attempt = _running()
    attempt.exited(0, 0, Exit(code=9))
    attempt.begin_stop()
    attempt.exited(0, 1, TERM)
    assert attempt.phase is Phase.STOPPING
    attempt.give_up()
    assert attempt.phase is Phase.ENDED
    result = attempt.result()
    assert result.root_rank == 0 and result.exit_status == 9
    assert [s.lost for s in result.states[2:]] == ["did not report its exit in time"] * 2


def test_a_failure_of_the_only_process_still_asks_for_a_stop():
    # The agents then signal whatever that process left in its process group.
    attempt = _running(hosts=1, nproc=1)
    attempt.exited(0, 0, Exit(code=1))
    assert attempt.phase is Phase.STOP
    attempt.begin_stop()
    assert attempt.phase is Phase.ENDED and attempt.result().exit_status == 1


def test_a_process_that_could_not_start_is_a_failure_with_its_reason():
    attempt = Attempt(_plan(1, 1))
    attempt.exited(0, 0, Exit(code=127, error="command not found: trian.py"))
    result = (attempt.begin_stop(), attempt.result())[1]
    assert result.exit_status == 127 and result.root.describe() == "exit 127: command not found: trian.py"
    assert result.root.describe() in ending_table(result)


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_restarts_run_a_failed_job_again_exactly_max_restarts_times(limit):
    restarts = Restarts(limit)
    runs = 0
    while True:
        attempt = _running(number=restarts.used)
        runs += 1
        attempt.exited(attempt.number, 0, Exit(signal=signal.SIGKILL))  # the OOM killer, say
        attempt.begin_stop()
        for rank in (1, 2, 3):
            attempt.exited(attempt.number, rank, TERM)
        result = attempt.result()
        assert result.number == runs - 1
        if not restarts.take(result):
            break
        assert restarts.used == runs
        assert restart_table(result, restarts).startswith(
            f"tpudist: attempt {runs} failed; restarting ({runs}/{limit} restarts)")
    assert runs == limit + 1 and result.exit_status == 128 + signal.SIGKILL


def test_restarts_are_not_used_on_success_or_interrupt():
    restarts = Restarts(5)
    ok = _running()
    for rank in range(4):
        ok.exited(0, rank, Exit(code=0))
    assert not restarts.take(ok.result())
    stopped = _running()
    stopped.interrupt(signal.SIGINT)
    stopped.begin_stop()
    for rank in range(4):
        stopped.exited(0, rank, TERM)
    assert not restarts.take(stopped.result()) and restarts.used == 0


def _failed(how, rank: int = 1, number: int = 0):
    """An attempt whose `rank` failed by `how` (an Exit, or "lost": its host's connection dropped)."""
    attempt = _running(number=number)
    if how == "lost":
        attempt.host_lost(attempt.states[rank].plan.worker, "SSH connection lost")
    else:
        attempt.exited(number, rank, how)
    attempt.begin_stop()
    for s in attempt.states:
        if not s.done:
            attempt.exited(number, s.plan.rank, TERM)
    return attempt.result()


INFRA = {  # the cause's text, as the restart's headline gives it
    "lost": "rank 0's host 10.0.0.2 was lost (host agent gone: SSH connection lost)",  # ranks 0, 1 there
    Exit(signal=signal.SIGKILL): "rank 1 was killed by SIGKILL (the OOM killer, a preemption or a kill -9)",
    Exit(signal=signal.SIGTERM): "rank 1 was killed by SIGTERM (sent from outside the launcher: a preemption?)",
    Exit(code=42): "rank 1 exited 42 (asks to be restarted)",
    Exit(code=137): "rank 1 exited 137 (128+9: a signal)",
}
PROGRAM = {
    Exit(code=1): "rank 1 exited 1 (an error in the program)",
    Exit(code=3): "rank 1 exited 3 (an error in the program)",
    Exit(code=127, error="python3.99: command not found"): "rank 1 could not start (python3.99: command not found)",
}


@pytest.mark.parametrize("how", list(INFRA), ids=str)
def test_infra_failures_restart_by_default_and_name_their_cause(how):
    result = _failed(how)
    assert failure_cause(result).text == INFRA[how]
    restarts = Restarts(2)
    assert restarts.take(result) and restarts.causes == [INFRA[how]]
    assert restart_table(result, restarts).splitlines()[0] == (
        f"tpudist: attempt 1 failed; restarting (1/2 restarts): {INFRA[how]}")


@pytest.mark.parametrize("how", list(PROGRAM), ids=str)
def test_the_programs_own_error_restarts_only_under_restart_on_any_and_says_so(how):
    result = _failed(how)
    infra = Restarts(2)
    assert not infra.take(result) and infra.used == 0
    assert infra.refusal(result) == f"not restarting: {PROGRAM[how]}; --restart-on any restarts it"
    anything = Restarts(2, on="any")
    assert anything.take(result) and anything.causes == [PROGRAM[how]] and anything.refusal(result) == ""


def test_the_last_table_says_how_many_restarts_happened_and_why_no_more():
    restarts = Restarts(2)
    assert restarts.take(_failed(Exit(signal=signal.SIGKILL), number=0))
    assert restarts.take(_failed("lost", number=1))
    last = _failed(Exit(code=42), number=2)
    assert not restarts.take(last) and restarts.used == 2
    assert ending_table(last).splitlines()[0] == (
        "tpudist: the job failed; every other process was stopped (attempt 3, after 2 restarts)")
    assert restarts.refusal(last) == "not restarting: all 2 restarts of --max-restarts 2 are used"
    assert Restarts(0).refusal(last) == ""  # none asked for: nothing to explain
