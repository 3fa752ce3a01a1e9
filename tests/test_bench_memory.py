"""`bench memory`, short: a tiny GPT through a job on the suite's Ray, every process found and measured.
Oracle: the processes the job runs (two workers, a coordinator, this driver) and the model's own size."""

import pytest

from elastic_zero.bench.memory import format_memory, run_memory_bench

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]


def test_the_memory_bench_measures_every_process_of_a_job_and_the_export(tmp_path):
    from elastic_zero.models import build_preset

    report = run_memory_bench(d_model=64, layers=2, heads=2, vocab=256, seq_len=16, workers=2, steps=3, meta=True,
                              workdir=str(tmp_path))
    expected = sum(p.numel() for p in build_preset("gpt-small", vocab_size=256, seq_len=16, n_layer=2, n_head=2,
                                                   d_model=64, tied_head=True).parameters())
    assert report["params"] == expected
    kinds = sorted(p["kind"] for p in report["processes"])
    assert kinds == ["coordinator", "driver", "worker", "worker"], kinds
    for p in report["processes"]:
        assert 0 < p["peak_gib"] == max(p["start_up_gib"], p["training_gib"])
    workers = [p for p in report["processes"] if p["kind"] == "worker"]
    assert all(p["training_gib"] > 0 and p["start_up_gib"] > 0 for p in workers)  # both phases were seen
    export = report["export"]
    assert export["written_gib"] * 2**30 >= 4 * expected and export["peak_gib"] >= export["imports_only_gib"] > 0
    assert "2 workers" in format_memory(report)
