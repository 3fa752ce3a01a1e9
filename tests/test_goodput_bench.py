"""The goodput benchmark's short variant, elastic_zero's side: the seeded schedule (a node frozen,
replaced by another, a node drained with a deadline and killed at it, a node added, a stop) played
to a real multi-node Ray cluster on this machine. The long one, with Ray Train beside it, runs by
command (`elastic-zero bench goodput`). Oracles: the schedule's own events, each answered as it
should be (a recovery from replicas with no step lost, a hand-off, scale-ups), and the sample
records: every sample of every step once. (It also stands for the frozen-node drill on a multi-node
cluster: both workers of the frozen node are lost by their silence, in one generation, and the
survivors on the other node go on from the replicas.)"""

import glob
import json

import pytest

from elastic_zero.bench.goodput import run_goodput_bench

pytestmark = [pytest.mark.runtime, pytest.mark.slow]


def test_elastic_zero_rides_out_the_goodput_schedule(tmp_path):
    # counted from the first step, so that a slow start (a loaded machine) cannot move the node loss
    # before training began
    report = run_goodput_bench(window_s=65, seed=1, notice_s=5, checkpoint_every=10, systems=("elastic_zero",),
                               work_root=str(tmp_path), clock="first_step")
    r = report["elastic_zero"]
    assert r["rc"] == 0 and r["error"] is None, r
    assert [p["action"] for p in r["played"]] == [e["action"] for e in report["schedule"]]
    # the frozen node: from the replicas; at most the step in flight is redone (the survivors may have
    # finished it, but the frozen node never committed it)
    assert r["recoveries"] == 1 and r["steps_redone"] <= 1, r
    assert r["reconfigurations"] >= 2, r  # a2's workers join; b's hand over and leave (c's may come too late)
    assert r["samples_kept"] == r["samples_trained"] == r["steps_kept"] * 16 and r["skipped_samples"] == 0
    sizes = [n for _, n in r["world_sizes"]]
    expected = iter([4, 2, 4, 2])  # lost, replaced (its joiners may come one at a time), handed over
    want = next(expected)
    for size in sizes:
        if size == want:
            want = next(expected, None)
    assert want is None, r["world_sizes"]
    assert 0 < r["productive_s"] < r["wall_s"] and 0 < r["goodput"] <= 1 and r["first_step_done_s"] < 65
    (events_path,) = glob.glob(str(tmp_path / "ez-goodput-elastic_zero-*" / "out" / "events.jsonl"))
    events = [json.loads(line) for line in open(events_path)]
    node_of = {e["actor_id"]: e["node"] for e in events if e["event"] == "worker_ready"}
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert len(lost) == 2 and all(e.get("silent_s") for e in lost), lost  # by silence, not the collective timeout
    assert len({node_of[e["actor_id"]] for e in lost}) == 1  # the frozen node's two workers, together
    assert not [e for e in events if e["event"] == "worker_unresponsive"]
    (recovery,) = [e for e in events if e["event"] == "generation_start" and e["source"] == "snapshot"]
    survivors = recovery["workers"]
    assert len(survivors) == 2 and node_of[lost[0]["actor_id"]] not in {node_of[a] for a in survivors}
