"""`elastic-zero bench pinning` (bench/pinning.py) on the CPU: without CUDA it measures only what
every way of pinning shares, fresh pages written by one thread and by several, and says so."""

import json

import pytest

import elastic_zero.bench.pinning as pinning
from elastic_zero.cli import main

pytestmark = pytest.mark.unit


def test_fresh_buffers_are_resident_once_written_by_any_number_of_threads():
    """The oracle is the process's own RSS: every page of the buffers written, whatever the split."""
    sizes = [24 << 20, 8 << 20, (4 << 20) + 123]  # one not a whole number of pages
    for way, threads in (("fault-1", 1), ("fault-N", 3)):
        result = pinning.measure_one(way, sizes, threads)
        assert result["bytes"] == sum(sizes)
        assert 0.95 * sum(sizes) <= result["rss_growth_bytes"] <= 1.2 * sum(sizes), (way, result)
        assert result["seconds"] > 0 and "pinned" not in result  # no CUDA here: nothing pinned is claimed


def test_each_way_runs_in_a_process_of_its_own_and_one_that_fails_is_reported(monkeypatch, capsys):
    """A torch that does not know an allocator option fails that way's process: the bench says why,
    and the other ways go on; --json prints one object."""
    monkeypatch.setattr(pinning, "CPU_WAYS", ("fault-1", "no-such-way", "fault-N"))
    assert main(["bench", "pinning", "--mib", "16", "--buffers", "2", "--threads", "2", "--rounds", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["device"].startswith("cpu (no CUDA") and report["bytes"] == 16 << 20
    # a line as each way ends (a run cut short by a time limit keeps them)
    assert [line.split(":")[1].strip() for line in err.splitlines()] == ["round 1, fault-1", "round 1, no-such-way",
                                                                         "round 1, fault-N"]
    assert list(report["ways"]) == ["fault-1", "no-such-way", "fault-N"]
    for way in ("fault-1", "fault-N"):
        (run,) = report["runs"][way]
        assert run["way"] == way and report["ways"][way]["bytes"] == 16 << 20
        assert 0.95 <= run["rss_growth_bytes"] / run["bytes"] <= 1.2  # measured in the way's own process
    assert "rc 1" in report["ways"]["no-such-way"]["error"]
    text = pinning.format_pinning(report)
    assert "no-such-way     failed: rc 1" in text and "fault-N" in text
    assert "launch gap" not in text  # the CUDA columns only where CUDA was measured


def test_the_rounds_median_is_taken_field_by_field():
    runs = [{"way": "torch", "seconds": s, "pinned": True, "bytes": 8} for s in (0.3, 0.1, 0.2)]
    assert pinning._medians(runs) == {"way": "torch", "seconds": 0.2, "pinned": True, "bytes": 8}
    assert pinning._medians([*runs[:2], {**runs[2], "pinned": False}])["pinned"] == [True, True, False]
    assert pinning._medians([*runs, {"way": "torch", "error": "rc 1: no"}]) == {"error": "rc 1: no"}


@pytest.mark.parametrize("args, message", [(["--mib", "0"], "--mib must be at least 1, got 0"),
                                           (["--threads", "0"], "--threads must be at least 1, got 0"),
                                           (["--buffers", "0"], "--buffers must be at least 1, got 0"),
                                           (["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                           (["--mib", "100000000"], "more than this machine has free")])
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys):
    assert main(["bench", "pinning", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


def test_torch_is_given_a_power_of_two_of_register_threads():
    """torch's allocator refuses pinned_num_register_threads that is not a power of two (at most 128)."""
    assert [pinning.register_threads(n) for n in (1, 2, 3, 6, 8, 12, 16, 500)] == [1, 2, 2, 4, 8, 8, 16, 128]
