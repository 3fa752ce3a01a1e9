"""A coordinator lost mid-run is replaced, and the replacement takes its workers over: training goes
on from the step they stopped at, from their memory, with no checkpoint read. Oracle: the same job
without the kill, at the same world size."""

import pytest

from runtime_jobs import exactly_once, job, relative

pytestmark = pytest.mark.runtime

COLLECTIVE_TIMEOUT_S = 30.0  # elastic.collective_timeout_s of these jobs (the default)


def _stall_s(summary, step: int) -> float:
    """Seconds between the end of the last step before `step` and the end of the first after it."""
    ends = dict(summary["step_end_curve"])
    return ends[step + 1] - ends[step]


def test_a_killed_coordinator_is_replaced_and_its_workers_train_on_from_their_memory(tmp_path):
    steps, kill_at = 40, 15
    elastic = {"collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    code, calm, _, expected = job(tmp_path, "calm", train={"steps": steps}, elastic=elastic)
    assert code == 0, calm.get("error")
    code, summary, events, weights = job(tmp_path, "killed", [{"at_step": kill_at, "action": "kill_coordinator",
                                                                "rank": 0}], train={"steps": steps}, elastic=elastic)
    assert code == 0, summary.get("error")
    kinds = [e["event"] for e in events]
    assert kinds.count("coordinator_restarted") == 1 and "generation_taken_over" in kinds, kinds
    (restarted,) = [e for e in events if e["event"] == "coordinator_restarted"]
    assert restarted["resume"] == "workers' memory"
    assert "checkpoint_restored" not in kinds  # no checkpoint was read: the memory held every shard
    assert summary["recoveries"] == [] or all(r.get("source") != "checkpoint" for r in summary["recoveries"])
    assert summary["steps"] == steps and summary["resumed_from_step"] == 0
    exactly_once(summary)
    assert relative(expected, weights) <= 1e-6
    stall = _stall_s(summary, kill_at)
    print(f"coordinator killed before step {kill_at}: the stall around it {stall:.2f} s")
    # the replacement's start and the take-over, seconds; nothing waits out a timeout (the store's,
    # the collective timeout, 30 s here, was waited out once: a connection asked of the lost store)
    assert stall < COLLECTIVE_TIMEOUT_S / 2, stall
