"""Ray's own autoscaler heals a spot cluster under a running job (issue 46): a head that trains
nothing and spot nodes of one worker each, started and stopped by the autoscaler's fake multi-node
provider on this machine (elastic_zero/bench/autoscaled_cluster.py, deploy/local-autoscaler/).

The loop: a job of 3 workers at min 2 asks for nodes labelled spot; a node is reclaimed (SIGKILL to
its processes, no notice) -> the job goes on at 2 from the replicas in memory -> its replacement
worker, pending, is a demand the autoscaler sees (the spot label, and not the node that went) ->
the autoscaler starts a node -> the worker joins at a safe point -> the job is back at 3. Oracles:
every sample of every step once, and the final weights of one uninterrupted worker."""

from __future__ import annotations

import json
import textwrap
import time

import pytest
import torch

from elastic_zero.bench.autoscaled_cluster import AutoscaledCluster
from runtime_jobs import relative

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

STEPS = 120
# the default loss; a step at 2 workers (a rank's share of the global batch of 8 is then 4) sleeps,
# so that the job, at 2 while the autoscaler brings a node, is still training when the worker joins
SLOW_AT_TWO = '''
import time

from elastic_zero.losses import next_token_loss


def loss(model, batch):
    if len(batch["input_ids"]) == 4:
        time.sleep(0.5)
    return next_token_loss(model, batch)
'''


def _spec() -> str:
    return textwrap.dedent(f"""\
        name = "autoscaled"
        [model]
        preset = "gpt-tiny"
        [train]
        loss = "slow_at_two:loss"
        steps = {STEPS}
        global_batch = 8
        micro_batch = 4
        [optimizer]
        name = "adamw"
        lr = 1e-3
        [zero]
        stage = 2
        [elastic]
        workers = 3
        min_workers = 2
        max_workers = 3
        replicate_every = 1
        worker_labels = {{"ray.io/market-type" = "spot"}}
        """)


@pytest.fixture
def cluster():
    cluster = AutoscaledCluster(auth=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def _events(path) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path)]
    except FileNotFoundError:
        return []


def _until_event(path, driver, log, what: str, check, timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = _events(path)
        if check(events):
            return events
        assert driver.poll() is None, open(log).read()[-3000:]
        assert time.monotonic() < deadline, f"not {what}: {events[-5:]}"
        time.sleep(0.2)


def test_a_reclaimed_spot_node_is_replaced_by_the_autoscaler_and_the_job_grows_back(cluster, tmp_path, one_worker):
    reference = one_worker(STEPS)
    (tmp_path / "slow_at_two.py").write_text(SLOW_AT_TWO)
    (tmp_path / "job.toml").write_text(_spec())
    weights, events_path, log = tmp_path / "final.pt", tmp_path / "out" / "events.jsonl", tmp_path / "driver.log"
    driver = cluster.head.run_job(str(tmp_path), "job.toml", "autoscaled", args=("--final-weights", str(weights)))
    try:
        _until_event(events_path, driver, log, "training on 3 workers",
                     lambda ev: any(e["event"] == "generation_start" for e in ev))
        deadline = time.monotonic() + 120
        while ((cluster.head.job_status("autoscaled") or {}).get("step") or 0) < 5:  # a few steps at 3
            assert driver.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
            time.sleep(0.5)
        events = _events(events_path)
        node_of = {e["actor_id"]: e["node"] for e in events if e["event"] == "worker_ready"}
        assert len(node_of) == 3 and len(set(node_of.values())) == 3, node_of  # the autoscaler's nodes, one worker each
        spot = {n["node_id"]: n for n in cluster.worker_nodes()}
        assert set(node_of.values()) <= set(spot), (node_of, list(spot))
        assert all(spot[n]["labels"].get("ray.io/market-type") == "spot" for n in node_of.values())
        victim = node_of["w1"]
        reclaimed_at = time.time()
        assert cluster.reclaim(victim) > 0
        events = _until_event(events_path, driver, log, "back at 3 workers",
                              lambda ev: len([e for e in ev if e["event"] == "generation_start"]) >= 3
                              and len([e for e in ev if e["event"] == "generation_start"][-1]["workers"]) == 3)
        assert driver.wait(timeout=300) == 0, open(log).read()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    events = _events(events_path)
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    starts = [e for e in events if e["event"] == "generation_start"]
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    assert lost["actor_id"] == "w1" and lost.get("silent_s"), lost  # by its silence
    assert starts[1]["source"] == "snapshot" and sorted(starts[1]["workers"]) == ["w0", "w2"], starts[1]
    (replacement,) = [e for e in events if e["event"] == "worker_ready" and e["actor_id"] not in node_of]
    assert replacement["node"] not in node_of.values()  # a node the autoscaler started for it
    assert starts[2]["source"] == "live" and replacement["actor_id"] in starts[2]["workers"], starts[2]
    assert summary["ok"] and summary["duplicate_samples"] == 0 and summary["skipped_samples"] == 0, summary
    assert relative(reference, torch.load(weights, weights_only=True)) <= 1e-4
    print(f"reclaim -> replacement ready {replacement['t'] - reclaimed_at:.1f} s, "
          f"-> back at 3 {starts[2]['t'] - reclaimed_at:.1f} s")
