"""`elastic-zero bench pinning` (bench/pinning.py) on the CPU: without CUDA it measures only what
every way of pinning shares, fresh pages written by one thread and by several, and says so."""

import json

import pytest

from elastic_zero.bench.pinning import format_pinning, measure_one
from elastic_zero.cli import main

pytestmark = pytest.mark.unit


def test_fresh_buffers_are_resident_once_written_by_any_number_of_threads():
    """The oracle is the process's own RSS: every page of the buffers written, whatever the split."""
    sizes = [24 << 20, 8 << 20, (4 << 20) + 123]  # one not a whole number of pages
    for way, threads in (("fault-1", 1), ("fault-N", 3)):
        result = measure_one(way, sizes, threads)
        assert result["bytes"] == sum(sizes)
        assert 0.95 * sum(sizes) <= result["rss_growth_bytes"] <= 1.2 * sum(sizes), (way, result)
        assert result["seconds"] > 0 and "pinned" not in result  # no CUDA here: nothing pinned is claimed


def test_the_bench_runs_each_way_in_a_process_of_its_own_and_reports_medians(capsys):
    assert main(["bench", "pinning", "--mib", "16", "--buffers", "2", "--threads", "2", "--rounds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # one JSON object
    assert report["device"].startswith("cpu (no CUDA")
    assert list(report["ways"]) == ["fault-1", "fault-N"] and report["bytes"] == 16 << 20
    for way, runs in report["runs"].items():
        assert len(runs) == 2 and {r["way"] for r in runs} == {way}
        assert report["ways"][way]["seconds"] == pytest.approx(sum(r["seconds"] for r in runs) / 2)
    text = format_pinning(report)
    assert "fault-N" in text and "launch gap" not in text  # the CUDA columns only where CUDA was measured


@pytest.mark.parametrize("args, message", [(["--mib", "0"], "--mib must be at least 1, got 0"),
                                           (["--threads", "0"], "--threads must be at least 1, got 0"),
                                           (["--buffers", "0"], "--buffers must be at least 1, got 0"),
                                           (["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                           (["--mib", "100000000"], "more than this machine has free")])
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys):
    assert main(["bench", "pinning", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


def test_a_way_that_fails_is_reported_and_the_others_go_on(monkeypatch):
    """A torch that does not know an allocator option fails that way's process: the bench says why."""
    import elastic_zero.bench.pinning as pinning

    monkeypatch.setattr(pinning, "CPU_WAYS", ("fault-1", "no-such-way"))
    report = pinning.run_pinning_bench(mib=2, buffers=1, threads=1, rounds=1)
    assert report["ways"]["fault-1"]["bytes"] == 2 << 20
    assert "rc 1" in report["ways"]["no-such-way"]["error"]
    assert "no-such-way     failed: rc 1" in format_pinning(report)
