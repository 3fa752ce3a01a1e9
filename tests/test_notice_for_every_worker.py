"""A spot notice that covers every worker (one VM, or a whole spot pool reclaimed at once): nobody is
left to take the shards, so the job saves a checkpoint of the step it reached at once, well before
the deadline, and trains on; run again with resume = "latest", it starts from that checkpoint with
every sample once. The notice comes from a stand-in IMDSv2 server on loopback, read by the real watcher.
Oracle: the step the notice checkpoint holds is the step the resumed job starts from."""

import threading
import time

import pytest
import ray

from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name
from fake_metadata import FakeMetadata
from runtime_jobs import exactly_once, job

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]

DEADLINE_S = 40.0


def _events(run_dir):
    import json

    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(run_dir, what, test, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = _events(run_dir)
        found = [e for e in events if test(e)]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s: {[e['event'] for e in _events(run_dir)][-20:]}")


def test_a_notice_for_every_worker_checkpoints_at_once_and_the_job_resumes_from_it(tmp_path):
    fake = FakeMetadata("aws")
    ckpt = {"uri": str(tmp_path / "ckpt"), "every": 1000, "keep": 3}
    watch = {"watch": ["aws"], "poll_s": 0.2, "aws_endpoint": fake.url}
    outcome = {}
    try:
        runner = threading.Thread(target=lambda: outcome.update(first=job(
            tmp_path, "noticed", train={"steps": 100000}, checkpoint=ckpt, preemption=watch,
            elastic={"workers": 2, "min_workers": 1, "max_workers": 2})))
        runner.start()
        run_dir = tmp_path / "noticed"
        _wait_for(run_dir, "first progress", lambda e: e["event"] == "decision" and e.get("on") == "GenerationStepped")
        _wait_for(run_dir, "a watcher", lambda e: e["event"] == "watcher" or e["event"] == "decision", 30)
        while not fake.tokens:  # the node's watcher is polling
            time.sleep(0.05)
        told_at = time.time()
        fake.change(notice={"action": "terminate", "time": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(told_at + DEADLINE_S))})
        committed = _wait_for(run_dir, "the notice's checkpoint", lambda e: e["event"] == "checkpoint_committed")
        ray.get(ray.get_actor(coordinator_name("noticed"), namespace=NAMESPACE).stop.remote(), timeout=30)
        runner.join(timeout=120)
    finally:
        fake.close()
    code, first, events, _ = outcome["first"]
    assert code == 0, first.get("error")
    kinds = [e["event"] for e in events]
    (notice,) = [e for e in events if e["event"] == "preemption_notice"]
    assert notice["source"] == "aws" and sorted(notice["actor_ids"]) == ["w0", "w1"]
    (asked,) = [e for e in events if e["event"] == "notice_checkpoint"]
    assert sorted(asked["actor_ids"]) == ["w0", "w1"]
    assert kinds.index("preemption_notice") < kinds.index("notice_checkpoint") < kinds.index("checkpoint_committed")
    # committed as it happened (not at the generation's end), long before the deadline
    assert committed["t"] - told_at < DEADLINE_S / 2, committed["t"] - told_at
    # nobody left: no generation after the first claims otherwise
    assert [e["workers"] for e in events if e["event"] == "generation_start"] == [["w0", "w1"]]
    step = int(committed["directory"].rsplit("-", 1)[1])
    assert 0 < step < first["stopped_at_step"] + 1 and step % ckpt["every"]  # the notice's, not a periodic one

    # the stop wrote the latest checkpoint (the weights the job ended with): resume from the notice's
    code, second, resumed_events, trained = job(tmp_path, "resumed", train={"steps": step + 10}, elastic={"workers": 1},
                                          checkpoint={**ckpt, "resume": str(step)})
    assert code == 0, second.get("error")
    assert second["resumed_from_step"] == step and second["steps"] == 10
    exactly_once(second)
    # its final checkpoint: step-{step + 10}, or step-{step + 10}-1 where the first job's stop came at
    # that same step and its checkpoint holds the name (seen under load: notice at 14, stop at 24)
    final_directory = [e for e in resumed_events if e["event"] == "checkpoint_committed"][-1]["directory"]
    named = f"{tmp_path / 'ckpt'}/step-{step + 10:010d}"
    assert final_directory in (named, named + "-1"), final_directory

    # resumed at its last step, or past it: nothing to train, and no worker starts; the checkpoint
    # resumed is the final weights (before: "the final weights could not be written: no commit was reported")
    for name, steps in (("past-the-end", step + 4),):  # (at the end: the same test, step >= steps)
        code, summary, events, weights = job(tmp_path, name, train={"steps": steps}, elastic={"workers": 2},
                                             checkpoint={**ckpt, "resume": "latest"})
        assert code == 0, summary.get("error")
        assert summary["note"] == (f"checkpoint.resume: {final_directory} is at step {step + 10}, "
                                   f"at or past train.steps = {steps}: nothing to train; it is the final weights")
        assert summary["steps"] == 0 and summary["resumed_from_step"] == step + 10
        assert not [e for e in events if e["event"] == "spawn"]
        assert weights.keys() == trained.keys() and all((weights[k] == trained[k]).all() for k in weights)
