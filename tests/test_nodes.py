"""Whole nodes on a real multi-node Ray cluster on this machine: a head with no CPUs (the driver
and the coordinator) and two worker nodes of two CPUs, four workers, two per node, each shard's
replica on the other node.

- Lost without warning: see tests/test_goodput_bench.py, whose schedule freezes a node of such a
  cluster (SIGSTOP to all its processes: a machine that vanished resets no connections) and checks
  that both its workers are lost by their silence in one generation and training goes on from the
  replicas in memory.
- Told before it goes: a worker gets SIGTERM, one node an AWS spot notice (from a fake metadata
  server on loopback), the other `ray drain-node`. Oracles: each is a preemption notice and a
  hand-off at a safe point (no recovery, no step recomputed), and no new worker is placed on a node
  that was told it goes.

Every sample of every step is counted exactly once and the job ends as asked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elastic_zero.testing.local_cluster import KEEP_DIRS_ENV, RAY_CLI, RayHead, RayNode
from fake_metadata import FakeMetadata

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

STEPS = 120
PACED = os.path.join(os.path.dirname(__file__), "paced.py")  # a paced loss, for jobs that run until stopped


def _spec(steps: int = STEPS, preemption: str = "", paced: bool = False) -> str:
    loss = 'loss = "paced:loss"' if paced else ""
    return textwrap.dedent(f"""\
        name = "nodes"
        [model]
        preset = "gpt-tiny"
        [train]
        {loss}
        steps = {steps}
        global_batch = 16
        micro_batch = 4
        [zero]
        stage = 2
        [elastic]
        workers = 4
        min_workers = 1
        max_workers = 4
        collective_timeout_s = 120
        """) + preemption


@pytest.fixture
def cluster(request):
    failed = request.session.testsfailed  # a failed test's cluster keeps its Ray logs
    head = RayHead(auth=False, num_cpus=0)
    nodes = []
    try:
        nodes = [RayNode(head, f"ez_node_{i}", num_cpus=2, index=i) for i in range(2)]
        yield head, nodes
    finally:
        keep = request.session.testsfailed > failed
        for node in nodes:
            node.stop(keep_dir=keep)
        head.stop(keep_dir=keep)
    if not (keep or os.environ.get(KEEP_DIRS_ENV)):  # nothing of theirs left on disk: their temp dirs, Ray's logs
        assert [d for d in (head.dir, *(n.dir for n in nodes)) if os.path.exists(d)] == []


def _start(head, tmp_path, job_id: str, steps: int = STEPS, preemption: str = "", paced: bool = False
           ) -> subprocess.Popen:
    shutil.copy(PACED, tmp_path / "paced.py")
    (tmp_path / "job.toml").write_text(_spec(steps, preemption, paced))
    return head.run_job(str(tmp_path), "job.toml", job_id)


def _until(head, tmp_path, driver, job_id: str, what: str, check, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        record = head.job_status(job_id)
        if record and check(record):
            return record
        assert driver.poll() is None, open(tmp_path / "driver.log").read()[-3000:]
        assert time.monotonic() < deadline, f"not {what}: {record}"
        time.sleep(1)


def _on_nodes(record: dict, nodes) -> dict:
    """{node id: its workers}, checked: two on each worker node, the coordinator on the head."""
    on_node = {n.node_id: sorted(m["actor_id"] for m in record["members"] if m["node"] == n.node_id) for n in nodes}
    assert sorted(len(a) for a in on_node.values()) == [2, 2], record["members"]
    assert record["coordinator"]["node"] not in on_node  # beside the driver, on the head
    return on_node


def _finished(driver, tmp_path, steps: int | None = STEPS) -> tuple[list[dict], dict]:
    """The job's events and summary, once it finished (or was stopped: steps None) with every
    sample counted exactly once."""
    try:
        assert driver.wait(timeout=300) == 0, open(tmp_path / "driver.log").read()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    events = [json.loads(line) for line in open(tmp_path / "out" / "events.jsonl")]
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["ok"] and summary["steps"] == (steps or summary["stopped_at_step"]), summary
    assert summary["duplicate_samples"] == 0 and summary["skipped_samples"] == 0, summary
    return events, summary


def _worker_pids(node) -> list[int]:
    pids = []
    for pid in node.processes():
        try:
            if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"ray::TrainingWorker"):
                pids.append(pid)
        except OSError:
            pass
    return pids


def _events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "out" / "events.jsonl")]


def _until_event(tmp_path, driver, what: str, check, timeout_s: float = 120) -> list[dict]:
    """Waits on the job's own event log (quicker to read than a status)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = _events(tmp_path)
        if check(events):
            return events
        assert driver.poll() is None, open(tmp_path / "driver.log").read()[-3000:]
        assert time.monotonic() < deadline, f"not {what}: {events[-5:]}"
        time.sleep(0.2)


def _ready_on(events, after: int) -> list[str]:
    return [e["node"] for e in events[after:] if e["event"] == "worker_ready"]


def test_a_sigterm_a_cloud_notice_and_a_ray_drain_are_handed_over_at_a_safe_point(cluster, tmp_path):
    """SIGTERM to a worker on node A; a third node C joins; an AWS spot notice for one of A and B
    (the fake metadata server tells only the first watcher's token); `ray drain-node` on the other.
    Each is a hand-off at a safe point (no recovery, no step recomputed); the replacements go to
    C, never to a node that was told it goes."""
    head, nodes = cluster
    fake = FakeMetadata("aws")
    try:
        preemption = f'[preemption]\nwatch = ["sigterm", "ray-drain", "aws"]\npoll_s = 0.2\naws_endpoint = "{fake.url}"\n'
        driver = _start(head, tmp_path, "notices", steps=100000, preemption=preemption, paced=True)
        record = _until(head, tmp_path, driver, "notices", "training on 4 workers",
                        lambda r: r["world_size"] == 4 and (r["step"] or 0) >= 3)
        on_node = _on_nodes(record, nodes)
        deadline = time.monotonic() + 30
        while len(fake.tokens) < 2:  # one watcher per node, each with its own session token
            assert time.monotonic() < deadline, fake.tokens
            time.sleep(0.1)
        (pid, *_) = _worker_pids(nodes[0])
        os.kill(pid, signal.SIGTERM)  # a pod deleted: it goes after the grace period
        _until_event(tmp_path, driver, "grown back to 4 after the SIGTERM",
                     lambda ev: [e["source"] for e in ev if e["event"] == "generation_start"] == ["init", "live", "live"])
        nodes.append(RayNode(head, "ez_node_2", num_cpus=2, index=2))
        mark = len(_events(tmp_path))
        # the newest token's holder lives (the SIGTERM'd worker may have been a watcher)
        fake.change(only_token=fake.tokens[-1], notice={"action": "terminate", "time": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))})
        events = _until_event(tmp_path, driver, "the replacements of the noticed node's workers joined",
                              lambda ev: len(_ready_on(ev, mark)) == 2 and
                              [e["workers"] for e in ev[mark:] if e["event"] == "generation_start"][-1:] != [] and
                              len([e for e in ev[mark:] if e["event"] == "generation_start"][-1]["workers"]) == 4)
        (aws,) = [e for e in events if e["event"] == "preemption_notice" and e.get("source") == "aws"]
        told = next(n for n in nodes if n.node_id == aws["node"])
        other = next(n for n in nodes[:2] if n is not told)
        assert _ready_on(events, mark) == [nodes[2].node_id] * 2, events[mark:]  # to C, not to the told node
        mark = len(events)
        drain = subprocess.run([*RAY_CLI, "drain-node", "--address",
                                head.gcs_address, "--node-id", other.node_id, "--reason",
                                "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                                "--deadline-remaining-seconds", "120"],
                               env=head.server_env, capture_output=True, text=True, timeout=60)
        assert drain.returncode == 0, drain.stderr[-2000:]
        _until_event(tmp_path, driver, "the drained node's workers handed over",
                     lambda ev: any(e["event"] == "generation_start" for e in ev[mark:]))
        stop = subprocess.run([sys.executable, "-m", "elastic_zero.cli", "stop", "notices", "--address",
                               head.gcs_address], env=head.client_env(), capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr[-2000:]
        events, summary = _finished(driver, tmp_path, steps=None)
    finally:
        fake.close()
    notices = [e for e in events if e["event"] == "preemption_notice"]
    assert [n["source"] for n in notices] == ["sigterm", "aws", "ray-drain"], notices
    assert notices[0]["actor_id"] in on_node[nodes[0].node_id]
    assert notices[2]["node"] == other.node_id and len(notices[2]["actor_ids"]) == 2
    assert not [e for e in events if e["event"] == "worker_lost"] and summary["recoveries"] == [], summary
    assert told.node_id not in _ready_on(events, events.index(notices[1]))
    assert other.node_id not in _ready_on(events, events.index(notices[2]))
    leaves = [c for c in summary["reconfigurations"] if c.get("cause") == "leave"]
    assert len(leaves) == 3, summary["reconfigurations"]
