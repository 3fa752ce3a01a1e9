"""Faults and bad input on a real local Ray: each ends in one of two ways, training goes on with
nothing lost, or the job stops within seconds with one line saying why."""

import time

import pytest

from runtime_jobs import exactly_once, job, relative

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]


@pytest.mark.parametrize("sections, field", [
    ({"data": {"source": "/no/such/file.parquet"}}, "data.source"),
    ({"model": {"preset": None, "factory": "json:loads"}}, "model"),  # the factory raises (no argument)
])
def test_a_worker_that_cannot_start_ends_the_job_with_one_line(tmp_path, sections, field):
    """Seen before: every worker raised in its constructor and the coordinator waited forever."""
    started = time.monotonic()
    code, summary, events, _ = job(tmp_path, "nostart", train={"steps": 5}, **sections)
    assert code == 1 and time.monotonic() - started < 60
    assert summary["error"].startswith("worker w") and f"failed to start: {field}" in summary["error"]
    assert "\n" not in summary["error"] and "Traceback" not in summary["error"]
    assert [e for e in events if e["event"] == "worker_start_failed"]


def test_unequal_shares_run_the_same_number_of_micro_batches(tmp_path, one_worker):
    """global_batch 9 over 2 workers: shares 5 and 4 with micro batches of 4 once took 2 and 1 micro
    batches, the collectives no longer matched and a worker died in std::terminate. Oracle: one
    worker on the same global batches."""
    reference = one_worker(12, 2, 9)
    code, summary, events, weights = job(tmp_path, "uneven", train={"steps": 12, "global_batch": 9, "micro_batch": 4})
    assert code == 0, summary.get("error")
    assert summary["recoveries"] == [] and summary["world_size_history"] == [[0, 2]]
    exactly_once(summary)
    assert relative(reference, weights) <= 1e-4


def test_a_bug_in_one_worker_ends_the_job_with_its_error(tmp_path):
    """An exception of the worker's own (here injected at every run of step 3) is not a fault:
    the job ends with it, not with the peers' 'connection closed', and nothing is replaced."""
    code, summary, events, _ = job(tmp_path, "bug", [{"at_step": 3, "action": "raise", "rank": 1}],
                                   train={"steps": 8})
    assert code == 1
    assert "injected error at step 3 (faults[0])" in summary["error"], summary["error"]
    assert [e["count"] for e in events if e["event"] == "spawn"] == [2]
