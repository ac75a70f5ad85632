"""The SLURM source: SLURM's compressed host lists and task counts, as SLURM's docs define them.

Expected expansions are written from the syntax SLURM documents for `scontrol show hostnames` and
`SLURM_TASKS_PER_NODE` (comma-separated items, bracketed ranges and lists, a range keeping the
zero padding of its lower bound, `N(xM)` repeating a task count M times), not from the parser.
No SLURM controller runs here; the source reads only environment variables, which the tests set.
"""

from __future__ import annotations

import socket

import pytest

from tpudist.launch.clusters.slurm import SlurmSource, expand_nodelist, expand_tasks_per_node
from tpudist.launch.config import ClusterOptions


def _args(**kw):
    return ClusterOptions(**kw)


@pytest.mark.parametrize("text, hosts", [
    ("tpu-[0-3,7],gpu1", ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-7", "gpu1"]),
    ("n[001-003]", ["n001", "n002", "n003"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("node1", ["node1"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("gpu[5,3]", ["gpu5", "gpu3"]),  # order as written
    ("x[0-0]", ["x0"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("n[3-1]", "runs backwards"),
    ("n[1-2", "never closed"),
    ("n]1[", "without '\\['"),
    ("n[a-b]", "is not N or N-M"),
    ("n[[1]]", "nested"),
    ("", "empty"),
    ("a,,b", "empty item"),
])
def test_malformed_nodelists_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        expand_nodelist(text)


@pytest.mark.parametrize("text, nodes, counts", [
    ("2(x3),1", 4, [2, 2, 2, 1]),
    ("4", 3, [4, 4, 4]),
    ("1,2,3", 3, [1, 2, 3]),
    ("8(x2)", 2, [8, 8]),
])
def test_expand_tasks_per_node(text, nodes, counts):
    assert expand_tasks_per_node(text, nodes) == counts


def test_tasks_per_node_that_do_not_match_the_nodes_are_refused():
    with pytest.raises(ValueError, match="gives 4 counts for 3 nodes"):
        expand_tasks_per_node("2(x3),1", 3)
    with pytest.raises(ValueError, match="is not N or N\\(xM\\)"):
        expand_tasks_per_node("2x3", 3)


def test_slurm_applies_inside_an_allocation_without_explicit_flags():
    env = {"SLURM_JOB_NODELIST": "tpu-[0-1]", "SLURM_JOB_ID": "42"}
    verdict = SlurmSource.applies(_args(), env)
    assert verdict.applies and "SLURM job 42" in verdict.reason
    assert not SlurmSource.applies(_args(), {}).applies
    assert "not inside a SLURM allocation" in SlurmSource.applies(_args(), {}).reason


@pytest.mark.parametrize("flag", [dict(hosts="a,b"), dict(hostfile="hosts"), dict(tpu="my-slice"),
                                  dict(local=True)])
def test_explicit_flags_win_over_the_allocation(flag):
    verdict = SlurmSource.applies(_args(**flag), {"SLURM_JOB_NODELIST": "tpu-[0-1]"})
    assert not verdict.applies and "explicit flags win" in verdict.reason


def test_slurm_resolves_nodes_in_allocation_order_with_uniform_tasks():
    env = {"SLURM_JOB_NODELIST": "tpu-[0-3,7],gpu1", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_TASKS_PER_NODE": "4(x6)"}
    cluster = SlurmSource.resolve(_args(), env)
    assert cluster.source == "slurm"
    assert [h.address for h in cluster.hosts] == ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-7",
                                                  "gpu1"]
    assert [h.slots for h in cluster.hosts] == [4] * 6
    assert cluster.accelerator_type is None and cluster.local is False


def test_slurm_per_node_task_counts_and_old_nodelist_name():
    env = {"SLURM_NODELIST": "n[001-003]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    cluster = SlurmSource.resolve(_args(), env)
    assert [(h.address, h.slots) for h in cluster.hosts] == [("n001", 2), ("n002", 2),
                                                             ("n003", 1)]


def test_slurm_without_task_counts_leaves_slots_to_the_launcher():
    cluster = SlurmSource.resolve(_args(), {"SLURM_JOB_NODELIST": "a,b"})
    assert [h.slots for h in cluster.hosts] == [None, None]


def test_slurm_errors_name_the_variable():
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='n\[1-': .*never closed"):
        SlurmSource.resolve(_args(), {"SLURM_JOB_NODELIST": "n[1-"})
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='1,1,1'.*3 counts for 2 nodes"):
        SlurmSource.resolve(_args(), {"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "1,1,1"})


def test_a_one_node_allocation_on_this_machine_runs_locally():
    this = socket.gethostname().split(".")[0]
    assert SlurmSource.resolve(_args(), {"SLURM_JOB_NODELIST": this}).local is True
    assert SlurmSource.resolve(_args(), {"SLURM_JOB_NODELIST": f"{this},other"}).local is False
