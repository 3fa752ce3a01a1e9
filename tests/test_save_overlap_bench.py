"""`elastic-zero bench save-overlap` on a small shard: it saves for real (the checkpoint it writes
commits, or the bench fails), reports the three ways side by side, and refuses bad arguments (sizes,
a directory) in one line."""

import pytest

import elastic_zero.bench.save_overlap as bench
from elastic_zero.cli import main

pytestmark = pytest.mark.unit


def test_the_bench_saves_a_shard_and_reports_three_ways(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "ALONE_S", 0.05)
    report = bench.run_save_overlap_bench(numel=50_001, rounds=2, directory=str(tmp_path))
    assert report["bytes"] == 3 * 4 * 50_001 and report["rounds"] == 2
    for way in ("save", "write_in_a_process", "copies_under_the_gil"):
        figures = report[way]
        # (>= 0: a write this small may end before the stand-in's first turn; the copies always may)
        assert len(figures["kept"]) == 2 and figures["kept_median"] >= 0 and figures["wall_s_median"] > 0
        wall, kept = figures["wall_s_median"], figures["kept_median"]  # (computed from them before rounding)
        assert figures["stood_still_s"] == pytest.approx(wall * max(0.0, 1.0 - kept), abs=1e-3 + 1e-3 * wall)
    assert list(tmp_path.iterdir()) == []  # its directory removed
    assert "copied under the GIL" in bench.format_save_overlap(report)


def test_a_save_that_fails_fails_the_bench(monkeypatch, tmp_path):
    import elastic_zero.checkpoint.writer as writer

    def no_room(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(bench, "ALONE_S", 0.05)
    monkeypatch.setattr(writer, "write_rank_file", no_room)
    with pytest.raises(RuntimeError, match="the save failed: r0: OSError: No space left on device"):
        bench.run_save_overlap_bench(numel=1_000, rounds=1, directory=str(tmp_path))


@pytest.mark.parametrize("args, message", [(["--numel", "0"], "--numel must be at least 1, got 0"),
                                           (["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                           (["--dir", "/no/such/dir"], "--dir '/no/such/dir' is not a directory"),
                                           (["--dir", "README.md"], "--dir 'README.md' is not a directory"),
                                           (["--numel", "10000000000000"], "more than this machine has free")])
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys):
    assert main(["bench", "save-overlap", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
