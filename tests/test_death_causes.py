"""A worker killed by Ray's memory monitor is told as that, with the node's figures. Pure: the
raylet's own message (its format string, from Ray 2.60's raylet) in, one line out."""

import pytest

from elastic_zero.coordinator.death_causes import is_memory_kill, memory_kill

pytestmark = pytest.mark.unit

RAYLET_SAYS = ("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
               "Worker exit detail: Task was killed due to the node running low on memory.\n"
               "Memory on the node (IP: 10.0.0.7, ID: 3f2a) was 22.81GB used / 24.00GB limit (0.950418)\n"
               "1 worker(s) were killed due to the node running low on memory. Refer to the documentation ...")


def test_a_memory_kill_is_told_with_the_nodes_figures():
    told = memory_kill(RAYLET_SAYS)
    assert told == "killed by Ray's memory monitor: node 10.0.0.7 had 22.81 GB in use of its 24.00 GB limit"
    assert is_memory_kill(told)


def test_other_deaths_are_not_memory_kills():
    assert memory_kill("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR") is None
    assert not is_memory_kill("lost in the final save") and not is_memory_kill(None)
    assert memory_kill("Task was killed due to the node running low on memory.") == \
        "killed by Ray's memory monitor (the node ran low on memory)"  # figures missing: still told
