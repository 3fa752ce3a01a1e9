"""A coordinator lost mid-run is replaced, and the replacement takes its workers over: training goes
on from the step they stopped at, from their memory, with no checkpoint read. Oracle: torch's AdamW
on one process (conftest's torch_adamw), as for the other runtime tests."""

import pytest

from elastic_zero.coordinator.takeover import ASK_S
from runtime_jobs import exactly_once, job, relative

pytestmark = pytest.mark.runtime

COLLECTIVE_TIMEOUT_S = 30.0  # elastic.collective_timeout_s of these jobs (the default)


def test_a_killed_coordinator_is_replaced_and_its_workers_train_on_from_their_memory(tmp_path, torch_adamw):
    """Killed four times, once more than the driver's COORDINATOR_RESTARTS: a step trained since a
    restart begins its count again. A worker lost first, under the coordinator killed next: the
    summaries its replacements write count that recovery too, as they count the samples."""
    # 15 steps apart: each after the safe point that ended the take-over before it (the workers train on
    # until the coordinator's process has ended: 10 steps in a second, seen in CI)
    steps, kills = 80, (15, 30, 45, 60)
    elastic = {"collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    expected = torch_adamw(steps)
    faults = [{"at_step": 8, "action": "kill", "rank": 1}]
    faults += [{"at_step": at, "action": "kill_coordinator", "rank": 0} for at in kills]
    code, summary, events, weights = job(tmp_path, "killed", faults, train={"steps": steps}, elastic=elastic)
    assert code == 0, summary.get("error")
    kinds = [e["event"] for e in events]
    restarted = [e for e in events if e["event"] == "coordinator_restarted"]
    assert [e["resume"] for e in restarted] == ["workers' memory"] * len(kills), restarted
    assert kinds.count("generation_taken_over") == len(kills), kinds
    assert "checkpoint_restored" not in kinds  # no checkpoint was read: the memory held every shard
    (lost,) = summary["recoveries"]
    assert lost["step"] == 8 and lost["source"] == "snapshot" and lost["failed_at"] < restarted[0]["t"], lost
    taken = [c for c in summary["reconfigurations"] if c["cause"] == "coordinator"]
    # a take-over is a change when the generation it took over stopped at a safe point; one that trained
    # on to the last step meanwhile (seen in CI: the workers notice the loss once the coordinator's
    # process has ended, and trained 10 steps in that second) just finished
    ends = {e["generation"]: e["outcomes"] for e in events if e["event"] == "generation_end"}
    stopped = [e for e in events if e["event"] == "generation_taken_over" and "finished" not in ends[e["generation"]]]
    assert len(stopped) >= len(kills) - 1 and len(taken) == len(stopped), (taken, stopped)
    # the replacement's start and the take-over, about a second each; nothing waits out a timeout (w1's
    # replacement, still starting when the first coordinator went, is not waited for: ASK_S; the
    # store's, the collective timeout, was waited out once: a connection asked of the lost store)
    assert all(c["stall_s"] < ASK_S for c in taken), taken
    assert summary["steps"] == steps and summary["resumed_from_step"] == 0
    exactly_once(summary)
    assert relative(expected, weights) <= 1e-4
    print(f"coordinator killed before steps {kills}: take-over stalls {[c['stall_s'] for c in taken]} s")
