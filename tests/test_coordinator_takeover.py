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


def _paced(model, batch):
    """The default loss, paced: the kill below lands between two checkpoints, well before the end."""
    import time

    from elastic_zero.losses import next_token_loss

    time.sleep(0.05)
    return next_token_loss(model, batch)


@pytest.mark.long  # a whole job's restart, about 20 s here: CI's budget; its books' part is test_books'
@pytest.mark.usefixtures("local_ray")
def test_a_coordinator_lost_with_all_its_workers_resumes_the_latest_checkpoint_and_counts_the_whole_job(
        tmp_path, torch_adamw):
    """The coordinator and every worker SIGKILLed together, past the checkpoint of step 10: the driver
    starts a coordinator that has nobody to take over, and it resumes the job's latest checkpoint.
    Before 2026-12-01 its summary began at that checkpoint (steps 45 of 60, resumed_from_step 15):
    the steps of its predecessor's last generation were in that checkpoint's records only."""
    import json
    import os
    import signal
    import threading
    import time

    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name

    steps, events_path, killed = 40, str(tmp_path / "all-lost" / "events.jsonl"), {}

    def kill_all_past_the_checkpoint_of_step_10() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = open(events_path).read().splitlines() if os.path.exists(events_path) else []
            events = [json.loads(line) for line in lines if line.strip()]
            if any(e["event"] == "checkpoint_committed" and e["directory"].endswith("step-0000000010") for e in events):
                coordinator = ray.get_actor(coordinator_name("all-lost"), namespace=NAMESPACE)
                pids = [ray.get(coordinator.status.remote())["coordinator"]["pid"]]
                pids += [e["pid"] for e in events if e["event"] == "worker_ready"]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed.update(pids=pids)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_all_past_the_checkpoint_of_step_10, daemon=True)
    killer.start()
    code, summary, events, weights = job(tmp_path, "all-lost", train={"steps": steps, "loss": _paced},
                                         checkpoint={"uri": str(tmp_path / "ckpt"), "every": 5, "keep": 2})
    killer.join(timeout=5)
    assert code == 0 and killed, (summary.get("error"), killed)
    (restarted,) = [e for e in events if e["event"] == "coordinator_restarted"]
    assert restarted["resume"] == "latest checkpoint" and "generation_taken_over" not in [e["event"] for e in events]
    (restored,) = [e for e in events if e["event"] == "checkpoint_restored"]
    assert restored["step"] >= 10 and summary["coordinator_restarts"] == 1
    # the whole job: every step's samples once, from step 0, and every generation's world size
    assert (summary["steps"], summary["resumed_from_step"]) == (steps, 0)
    exactly_once(summary)
    assert summary["world_size_history"] == [[0, 2], [restored["step"], 2]]
    assert relative(torch_adamw(steps), weights) <= 1e-4
