"""`bench memory`, short: a tiny GPT through a job on the suite's Ray, every process found and measured.
Oracle: the processes the job runs (two workers, a coordinator, this driver) and the model's own size."""

import pytest

from elastic_zero.bench.memory import format_memory, run_memory_bench

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]


def test_the_memory_bench_measures_every_process_of_a_job_and_the_export(tmp_path):
    from elastic_zero.models import build_preset

    report = run_memory_bench(d_model=64, layers=2, heads=2, vocab=256, seq_len=16, workers=2, steps=300, meta=True,
                              replicate_every=1, events=True, workdir=str(tmp_path))
    expected = sum(p.numel() for p in build_preset("gpt-small", vocab_size=256, seq_len=16, n_layer=2, n_head=2,
                                                   d_model=64, tied_head=True).parameters())
    assert report["params"] == expected
    kinds = [p["kind"] for p in report["processes"]]
    # the two it started (a replacement and the scale-up's joiner come if the job lasts long enough)
    assert kinds.count("coordinator") == 1 and kinds.count("driver") == 1 and kinds.count("worker") >= 2, kinds
    for p in report["processes"]:
        assert 0 < p["peak_gib"] == max(p["start_up_gib"], p["training_gib"])
    workers = [p for p in report["processes"] if p["kind"] == "worker"]
    assert sum(p["start_up_gib"] > 0 for p in workers) == 2 and all(p["training_gib"] > 0 for p in workers)
    # (the scale-up's and the notice's hand-offs come when the joiners are ready: seconds, which a job
    # of a tiny model may not last; at real sizes, steps of seconds, they come in turn)
    names = {e["event"] for e in report["events"]}
    assert {"kill and recovery", "checkpoint save"} <= names, names
    assert all(e["seconds"] >= 0 and e["extra_peak_gib"] >= 0 for e in report["events"])
    export = report["export"]
    assert export["written_gib"] * 2**30 >= 4 * expected and export["peak_gib"] >= export["imports_only_gib"] > 0
    assert "2 workers" in format_memory(report)


def test_event_windows_and_their_extra_peaks_from_a_timeline():
    """Pure: the windows come from the summary and the events; each one's extra is the largest rise
    of a worker over its own steady state just before it."""
    from elastic_zero.bench.memory import GIB, event_peaks, event_windows

    summary = {"step_time_s_median": 1.0,
               "recoveries": [{"failed_at": 110.0, "to_next_step_done_s": 3.0}],
               "reconfigurations": [{"failed_at": 120.0, "to_next_step_done_s": 2.0, "cause": "leave"},
                                    {"failed_at": 130.0, "to_next_step_done_s": 2.0, "cause": "scale"}]}
    records = [{"event": "checkpoint_committed", "t": 105.0}, {"event": "checkpoint_committed", "t": 90.0}]
    windows = event_windows(summary, records, started=100.0)
    assert windows == [("checkpoint save", 104.0, 105.0), ("kill and recovery", 110.0, 113.0),
                       ("preemption hand-off", 120.0, 122.0), ("scale-up hand-over", 130.0, 132.0)]
    # GiB of worker 7: its steady peak before each event is 3, then 4 once the world shrank (its shard grew)
    rss = {101.0: 2, 102.0: 3, 104.5: 4, 107.0: 3, 111.0: 5, 115.0: 4, 121.0: 4.5, 125.0: 4, 131.0: 4}
    samples = [(t, {7: ("worker", int(v * GIB)), 9: ("driver", 10 * GIB)}) for t, v in sorted(rss.items())]
    peaks = event_peaks(samples, first_step=100.5, windows=windows, shard_bytes=GIB)
    assert [(p["event"], p["extra_peak_gib"], p["of_a_shard"]) for p in peaks] == [
        ("checkpoint save", 1.0, 1.0), ("kill and recovery", 2.0, 2.0), ("preemption hand-off", 0.5, 0.5),
        ("scale-up hand-over", 0.0, 0.0)]
