"""`bench data` at a tiny size: the report's fields, and every sample of the read range read exactly once."""

import os

import numpy as np
import pyarrow.dataset as ds
import pytest

from elastic_zero.bench.data import _read_once, format_data_report, run_data_bench
from elastic_zero.bench.token_dataset import token_dataset

pytestmark = pytest.mark.runtime  # spawns reader processes


@pytest.mark.long  # a bench end to end (10 s of CI's two cores); its dataset's premise and its reads' check are tested below, in seconds
def test_bench_data_reads_every_sample_once_on_both_sides_and_reports_the_goals(tmp_path):
    r = run_data_bench(size_gb=0.002, directory=str(tmp_path), seq_len=1024, workers=2, global_batch=8, rounds=1,
                       batch_rows=16)
    rows = 2_000_000 // (1025 * 4)
    assert r["rows"] == rows and r["workers"] == 2 and r["dataset_gb"] == pytest.approx(0.002, rel=0.01)
    assert r["blocks"] > r["files"]  # several record batches per file: the reads cross blocks
    assert r["steps_per_round"] == rows // 8 and r["samples_per_round"] == rows // 8 * 8
    assert r["samples_unread_per_round"] == rows % 8
    # the bench checks the first token of every tensor row (the row's index) against the order's positions
    assert r["ours_each_sample_once"] and r["baseline_each_sample_once"]
    assert r["samples_per_s"] > 0 and r["baseline_samples_per_s"] > 0
    assert r["ratio"] == pytest.approx(r["samples_per_s"] / r["baseline_samples_per_s"])
    for side in ("ours_workers", "baseline_workers"):
        assert [w["rank"] for w in r[side]] == [0, 1]
        for w in r[side]:
            assert set(w["rss_growth_mb"]) == {"anon", "anon_peak", "total", "total_peak"}
            assert w["rss_growth_mb"]["anon_peak"] >= w["rss_growth_mb"]["anon"]
    assert r["ours_workers"][0]["blocks_read_per_round"] >= r["blocks"] // 2
    assert set(r["goals_met"]) == {"memory", "speed"} and all(isinstance(v, bool) for v in r["goals_met"].values())
    assert "ratio ours/baseline" in format_data_report(r)

    # the oracle's premise: row i of the dataset starts with token i; and the dataset is reused
    tokens = ds.dataset(r["dataset"], format="ipc").to_table().column("tokens").combine_chunks()
    assert tokens.flatten().to_numpy().reshape(rows, 1025)[:, 0].tolist() == list(range(rows))
    before = {p: os.path.getmtime(os.path.join(r["dataset"], p)) for p in os.listdir(r["dataset"])}
    token_dataset(str(tmp_path), 0.002, "ipc", 1024, 16)
    assert before == {p: os.path.getmtime(os.path.join(r["dataset"], p)) for p in os.listdir(r["dataset"])}


def test_the_bench_dataset_starts_row_i_with_token_i_and_is_made_once(tmp_path):
    """The premise of the bench's check (the long test above runs it end to end): row i of the token
    dataset starts with token i, and a dataset made before is reused, not written again."""
    made = token_dataset(str(tmp_path), 0.002, "ipc", 1024, 16)
    rows = 2_000_000 // (1025 * 4)
    tokens = ds.dataset(made["path"], format="ipc").to_table().column("tokens").combine_chunks()
    assert made["rows"] == rows
    assert tokens.flatten().to_numpy().reshape(rows, 1025)[:, 0].tolist() == list(range(rows))
    before = {p: os.path.getmtime(os.path.join(made["path"], p)) for p in os.listdir(made["path"])}
    assert token_dataset(str(tmp_path), 0.002, "ipc", 1024, 16)["path"] == made["path"]
    assert before == {p: os.path.getmtime(os.path.join(made["path"], p)) for p in os.listdir(made["path"])}


def test_a_sample_read_twice_or_missed_fails_the_check():
    once = np.array([1, 1, 0])
    assert _read_once([[{"sample_ids": np.array([1])}, {"sample_ids": np.array([0])}]], once)
    assert not _read_once([[{"sample_ids": np.array([1])}, {"sample_ids": np.array([1])}]], once)
    assert not _read_once([[{"sample_ids": np.array([0])}, {"sample_ids": np.array([-1])}]], once)
