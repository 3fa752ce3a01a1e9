"""`bench memory` and `bench state-size`, short: a tiny GPT through jobs on the suite's Ray, every process
found and measured, every elastic event found in what the jobs wrote. Oracles: the processes a job
runs (workers, a coordinator, this driver), the model's own size, and timelines made by hand."""

import os
import subprocess
import time

import pytest

from elastic_zero.bench.memory import GIB, Sampler, format_memory, processes_below, run_memory_bench
from elastic_zero.bench.state_events import (EventWindow, change_windows, extra_peaks, quiet_steps, rate_row,
                                             save_windows, start_up_extra, steady_peaks, swap_windows)


def _param_count(**config) -> int:
    from elastic_zero.models import build_preset

    return sum(p.numel() for p in build_preset("gpt-small", tied_head=True, **config).parameters())


# what a worker may hold beside its engine's state in the memory check below: the interpreter with
# torch and Ray (about 0.42 GiB), the steps' heap, activations and units. Measured (3 runs):
# 0.54-0.61 GiB beside 0.09 GiB of state; a second copy of the state, or replicas kept where they do
# not fit (0.27 GiB here), goes past it.
BESIDE_STATE_GIB = 0.66


@pytest.mark.runtime
@pytest.mark.usefixtures("local_ray")
def test_memory_check_every_process_of_a_zero3_job_against_its_state_and_the_exports(tmp_path):
    """The memory check of CI: a 12M GPT at ZeRO-3 on 2 workers, replicas asked for, on a node where
    the job may hold 1.6 GiB: the plan drops the replicas, saying so with its numbers, and every
    process's exact peak stays within the engine's state plus a stated allowance; exporting the
    final weights to safetensors or a .pt holds a tensor at a time, never the model (48 MB here)."""
    config = dict(d_model=384, layers=6, heads=6, vocab=4096, seq_len=32)
    report = run_memory_bench(**config, workers=2, steps=4, global_batch=8, micro_batch=4, replicate_every=1,
                              memory_per_node_gib=1.6, workdir=str(tmp_path))
    expected = _param_count(vocab_size=4096, seq_len=32, n_layer=6, n_head=6, d_model=384)
    assert report["params"] == expected
    kinds = sorted(p["kind"] for p in report["processes"])
    assert kinds == ["coordinator", "driver", "worker", "worker"], kinds
    (warning,) = report["warnings"]
    assert warning.startswith("replicas dropped at 2 worker(s): each would hold ") and warning.endswith(
        "GiB for each of its workers")
    plan = report["plan"]
    assert plan["replicas"] is False and plan["workers"] == 2 and plan["need_gib"] <= plan["room_gib"] == 0.8
    state_gib = 16 * expected / 2 / GIB
    for p in report["processes"]:
        assert 0 < p["peak_gib"] == max(p["start_up_gib"], p["training_gib"]) <= p["exact_peak_gib"]
        if p["kind"] == "worker":
            assert p["exact_peak_gib"] <= state_gib + BESIDE_STATE_GIB, (p, state_gib)
        if p["kind"] == "coordinator":  # no tensor ever: no torch either
            assert p["exact_peak_gib"] <= 0.25, p
    for key in ("export", "export_pt"):
        export = report[key]
        assert export["written_gib"] * 2**30 >= 4 * expected, export
        assert export["peak_gib"] - export["imports_only_gib"] < 0.75 * 4 * expected / GIB, export  # not a whole copy
    assert "2 workers" in format_memory(report)


@pytest.mark.runtime
@pytest.mark.long  # a bench's own check, jobs end to end; the rules it reads by are tested below, in seconds
@pytest.mark.usefixtures("local_ray")
def test_the_state_size_bench_finds_every_event_of_its_jobs(tmp_path):
    from elastic_zero.bench.state_size import format_state_size, run_state_size_bench

    report = run_state_size_bench(d_model=64, layers=2, heads=2, vocab=256, seq_len=16, workers=3, steps=60,
                                  workdir=str(tmp_path))
    assert report["params"] == _param_count(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=64)
    assert all(v > 0 for v in report["links_gb_per_s"].values())
    names = [e["event"] for e in report["events"]]
    # (the replacements' joining, a scale-up, comes when they are ready: seconds, which a job of a tiny
    # model may not last; at real sizes, steps of seconds, it comes in turn)
    for wanted in ("replica swap", "kill and recovery", "checkpoint save", "resume at 2 workers",
                   "export (its own process)"):
        assert wanted in names, names
    for e in report["events"]:  # (an event shorter than the sampling period may catch no sample: None)
        assert (e["extra_peak_gib"] is None or e["extra_peak_gib"] >= 0) and e["seconds"] >= 0
        assert e["moved_gib"] is not None and e["moved_gib"] >= 0, e
    assert any(e["extra_peak_gib"] is not None for e in report["events"]), report["events"]
    kinds = [p["kind"] for p in report["processes"]]
    assert kinds.count("coordinator") == 1 and kinds.count("worker (resumed)") == 2, kinds
    assert "kill and recovery" in format_state_size(report)


@pytest.mark.unit
def test_event_windows_from_a_summary_and_its_events():
    summary = {"step_end_curve": [[0, 101.0], [1, 102.0], [2, 103.0], [3, 104.0], [4, 105.0], [5, 106.0],
                                  [6, 112.0]],
               "step_time_curve": [[s, 1.0] for s in range(7)],
               "protect_time_curve": [[s, 0.25] for s in range(7)],
               "recoveries": [{"failed_at": 110.0, "to_next_step_done_s": 3.0, "received_bytes": 40,
                               "phases_s": {"groups": 0.1, "handover": 0.5}}],
               "reconfigurations": [{"failed_at": 120.0, "to_next_step_done_s": 2.0, "cause": "leave",
                                     "received_bytes": 10, "phases_s": {"handover": 0.2}, "from": 3, "to": 2},
                                    {"failed_at": 130.0, "to_next_step_done_s": 2.0, "cause": "scale", "from": 2,
                                     "to": 3},
                                    {"failed_at": 140.0, "to_next_step_done_s": 1.0, "cause": "scale", "from": 3,
                                     "to": 2}]}
    # commits after steps 2 and 5 (every 3): a swap is its step and the next, and counts only if it ended before
    assert swap_windows(summary, 3, before=113.0, shard_bytes=7) == [
        EventWindow("replica swap", 102.0, 104.0, 7, 0.5, "loopback"),
        EventWindow("replica swap", 105.0, 112.0, 7, 0.5, "loopback")]
    assert swap_windows(summary, 3, before=110.0, shard_bytes=7) == [
        EventWindow("replica swap", 102.0, 104.0, 7, 0.5, "loopback")]
    assert change_windows(summary) == [
        EventWindow("kill and recovery", 110.0, 113.0, 40, 0.5, "loopback"),
        EventWindow("preemption hand-off (3 -> 2)", 120.0, 122.0, 10, 0.2, "loopback"),
        EventWindow("scale-up hand-over (2 -> 3)", 130.0, 132.0, None, None, "memory"),
        EventWindow("scale-down hand-over (3 -> 2)", 140.0, 141.0, None, None, "memory")]
    records = [{"event": "checkpoint_committed", "t": 105.5, "directory": "/c/step-0000000004"},
               {"event": "checkpoint_committed", "t": 99.0, "directory": "/c/step-0000000000"}]
    # step-4 holds 4 steps done: written from the end of step 3, one of its 2 writers' part
    assert save_windows(summary, records, {"/c/step-0000000004": (4, 600, 2)}) == [
        EventWindow("checkpoint save", 104.0, 105.5, 300, 1.5, "memory")]


@pytest.mark.unit
def test_extra_peaks_hold_each_event_against_the_quiet_steps_before_the_first():
    # steps of 1 s ending at 101..106; replicas every 3: steps 2, 5 make a swap, 3 finishes one, 1 and 4 are quiet
    summary = {"step_end_curve": [[s, 101.0 + s] for s in range(6)], "step_time_curve": [[s, 1.0] for s in range(6)]}
    assert quiet_steps(summary, 3, before=106.5) == [(101.0, 102.0), (104.0, 105.0)]
    assert quiet_steps(summary, 1, before=103.5) == [(101.0, 102.0), (102.0, 103.0)]  # every step swaps
    # GiB of workers 7 and 8 (8 a replacement, started later)
    rss = {101.5: (3, None), 103.5: (4.5, None), 104.5: (3.2, None), 110.0: (5, 1), 112.0: (3, 4.0)}
    samples = [(t, {pid: ("worker", int(v * GIB)) for pid, v in ((7, a), (8, b)) if v is not None} | {9: ("driver", 9 * GIB)})
               for t, (a, b) in sorted(rss.items())]
    steady = steady_peaks(samples, quiet_steps(summary, 3, before=106.5))
    assert steady == {7: int(3.2 * GIB)}
    windows = [EventWindow("replica swap", 103.0, 104.0), EventWindow("kill and recovery", 109.0, 113.0)]
    # the swap: 4.5 - 3.2; the recovery: worker 8 is held against the lowest steady peak, 4 - 3.2 < 5 - 3.2
    assert [round(e / GIB, 3) for e in extra_peaks(samples, steady, windows)] == [1.3, 1.8]
    # a resumed job: 5 GiB while reading the checkpoint, 4 once training
    resumed = [(t, {3: ("worker", int(v * GIB))}) for t, v in ((1.0, 5), (2.0, 3.5), (3.0, 4))]
    assert start_up_extra(resumed, first_step_done=2.0) == GIB
    # not measured is not 0: a window no sample fell in, a job that ended before its next sample
    assert extra_peaks(samples, steady, [EventWindow("checkpoint save", 105.0, 105.05)]) == [None]
    assert start_up_extra(resumed, first_step_done=3.0) is None


@pytest.mark.unit
def test_a_row_holds_the_peak_against_a_shard_and_the_rate_against_its_link():
    row = rate_row("kill and recovery", 12.34, 3.0, GIB // 2, GIB, 2 * 10**9, 2.0, "loopback",
                   {"loopback": 4e9, "memory": 10e9})
    assert row == {"event": "kill and recovery", "at_s": 12.3, "seconds": 3.0, "extra_peak_gib": 0.5,
                   "of_a_shard": 0.5, "moved_gib": round(2e9 / GIB, 3), "moving_s": 2.0, "gb_per_s": 1.0,
                   "link": "loopback", "of_link": 0.25}
    assert rate_row("export", None, 1.0, 0, GIB, None, None, "memory", {"memory": 1e9})["gb_per_s"] is None
    unmeasured = rate_row("checkpoint save", 1.0, 0.05, None, GIB, 10, 0.05, "memory", {"memory": 1e9})
    assert unmeasured["extra_peak_gib"] is None and unmeasured["of_a_shard"] is None


@pytest.mark.unit
def test_the_sampler_counts_only_the_actors_that_started_in_its_block():
    """An earlier job's worker still exiting in a reused Ray is not this job's (seen with two test processes)."""
    def fake_worker():  # a process Ray would have named after a TrainingWorker, below this one
        return subprocess.Popen(["bash", "-c", "exec -a ray::TrainingWorker sleep 30"])

    earlier = fake_worker()
    try:
        deadline = time.monotonic() + 10
        while earlier.pid not in processes_below(os.getpid()):  # exec'd under its new name
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with Sampler(period_s=0.02) as sampler:
            ours = fake_worker()
            try:
                while not any(ours.pid in s for _, s in sampler.samples):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            finally:
                ours.kill()
        assert not any(earlier.pid in s for _, s in sampler.samples)
    finally:
        earlier.kill()


@pytest.mark.unit
def test_the_exact_peak_never_falls_below_what_was_read_before():
    """The kernel's VmHWM may read lower than an earlier VmRSS (it moves only at some events): the
    exact peak the memory check holds every sample against is the most ever read, never the last."""
    me = os.getpid()
    high_water = {}
    rss = processes_below(me, high_water)[me][1]
    assert high_water[me] >= rss > 0  # the same read's VmHWM, or its VmRSS
    high_water[me] = 2**50  # an earlier read, more than this process will ever hold
    processes_below(me, high_water)
    assert high_water[me] == 2**50


@pytest.mark.unit
def test_only_the_workers_a_job_names_are_the_jobs():
    """An earlier job's worker that Ray started after that job ended (its spawn cancelled, seen in CI)
    appears inside the next job's sampling; the job's own workers may be gone one sample after its
    first step (a job of two tiny steps, seen in CI): only the pids of its events count."""
    sampler = Sampler()
    stray, ours, coordinator = ("worker", 1 << 20), ("worker", 2 << 20), ("coordinator", 3 << 20)
    sampler.samples = [(10.0, {7: stray, 9: coordinator}), (10.1, {7: stray, 8: ours, 9: coordinator}),
                       (10.2, {9: coordinator}), (10.3, {})]
    assert sampler.of_job({8}) == [(10.0, {9: coordinator}), (10.1, {8: ours, 9: coordinator}),
                                   (10.2, {9: coordinator}), (10.3, {})]
    assert sampler.of_job(set()) == [(10.0, {9: coordinator}), (10.1, {9: coordinator}), (10.2, {9: coordinator}),
                                     (10.3, {})]


@pytest.mark.unit
def test_the_state_size_table_keeps_its_columns_under_a_long_event_name():
    from elastic_zero.bench.state_size import format_state_size

    def event(name, at):
        return {"event": name, "at_s": at, "seconds": 0.5, "extra_peak_gib": 0.01, "of_a_shard": 1.0, "moved_gib": 0.02,
                "moving_s": 0.03, "gb_per_s": 0.7, "link": "loopback", "of_link": 0.1}

    report = {"config": {"d_model": 64, "layers": 2, "vocab": 256, "workers": 12, "replicate_every": 1}, "params": 1,
              "adamw_state_gib": 0.0, "shard_gib": 0.0, "links_gb_per_s": {"memory": 20.0, "loopback": 5.0},
              "step_time_s_median": 0.1, "steady_worker_peak_gib": 0.5, "processes": [],
              "events": [event("kill and recovery", 7.9), event("scale-down hand-over (12 -> 11)", 11.4),
                         {**event("checkpoint save", 12.0), "extra_peak_gib": None, "of_a_shard": None}]}
    lines = format_state_size(report).splitlines()
    assert lines[-2].split()[:6] == ["checkpoint", "save", "12.0", "0.5", "-", "-"], lines[-2]
    header = next(line for line in lines if line.startswith("event"))
    rows = [line for line in lines if line.startswith(("kill", "scale"))]
    assert [row.index(at) + len(at) for row, at in zip(rows, ("7.9", "11.4"))] == [header.index("at (s)") + 6] * 2, lines
