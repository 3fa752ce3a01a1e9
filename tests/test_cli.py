"""The command line end to end: the README's main job (small) and the step benchmark's JSON."""

import json
import subprocess
import sys

import pytest
import torch

from elastic_zero.models import build_preset

CLI = [sys.executable, "-m", "elastic_zero.cli"]


def _run(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_run_a_spec_with_overrides_writes_summary_events_and_weights(tmp_path):
    # two workers where the spec says three (one worker's start less: CI's time)
    out = _run("run", "examples/jobs/tiny.toml", "--set", "train.steps=12", "--set", "faults=[]",
               "--set", "elastic.workers=2", "--run-dir", str(tmp_path / "run"), "--final-weights", str(tmp_path / "w.pt"))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["ok"] and summary["world_size_history"] == [[0, 2]]
    assert summary["param_count"] == 136960 and summary["duplicate_samples"] == 0
    # ZeRO-2 on 2 ranks: the full fp32 parameters, half of the gradient and of AdamW's two moments
    # (each unit's chunks padded to 16 elements a rank)
    assert 1.0 <= summary["engine_bytes_per_rank"] / (136960 * (4 + 12 / 2)) <= 1.01, summary["engine_bytes_per_rank"]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "job_start" and events[-1]["event"] in ("job_finished", "retire")
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert set(weights) == set(build_preset("gpt-tiny").state_dict())


def test_bench_step_json_reports_the_contract_fields():
    out = _run("bench", "step", "--stage", "2", "--workers", "2", "--preset", "gpt-tiny",
               "--steps", "2", "--warmup", "1", "--rounds", "1", "--replicate-every", "1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in ("stage", "workers", "median_step_s", "ddp_median_step_s", "ratio_vs_ddp",
                "optimizer_bytes_per_rank", "optimizer_bytes_theory", "replicas_overlapped_blocking_share",
                "replicas_synchronous_blocking_share", "replicas_overlapped_ratio_vs_off"):
        assert key in report, key
    assert report["replicas_overlapped_blocking_share"] == pytest.approx(
        report["replicas_overlapped_blocking_median_s"] / report["median_step_s"])
    assert report["stage"] == "2" and report["workers"] == 2
    assert report["ratio_vs_ddp"] == pytest.approx(report["median_step_s"] / report["ddp_median_step_s"])
    assert 1.0 <= report["optimizer_bytes_per_rank"] / report["optimizer_bytes_theory"] <= 1.02


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "--set", "model.preset=gpt-huge"), "model.preset: got 'gpt-huge'"),
        (("run", "examples/jobs/tiny.toml", "--set", "zero.stage=5"), "zero.stage: got 5; allowed: 1, 2, 3"),
        (("run", "missing.toml"), "missing.toml: no such spec file"),
        (("run", "--set", "data.source=/no/such/file.parquet"), "data.source: no such file or directory"),
        (("run", "--set", "checkpoint.uri=README.md/ckpt", "--set", "checkpoint.every=5"),
         "checkpoint.uri: cannot write to 'README.md/ckpt'"),
        (("run", "--set", "checkpoint.uri=README.md", "--set", "checkpoint.resume=latest"),
         "checkpoint.uri: cannot write to 'README.md'"),  # seen before: a silent fresh start (every job writes there now)
        (("bench", "step", "--stage", "2", "--steps", "1", "--rounds", "3"), "steps >= rounds"),
        (("bench", "step", "--stage", "ddp", "--replicate-every", "1"), "--replicate-every needs a ZeRO --stage"),
        (("bench", "overhead", "--steps", "3"), "--steps >= 10"),
        (("run", "--set", "model.factory=no_such_mod:build"),  # replaces the demo's preset
         "model.factory: cannot import 'no_such_mod'"),
        (("run", "--set", "train.loss=json:nope"), "train.loss: module 'json' has no 'nope'"),
        (("run", "--set", "data.source=README.md"), "data.source: cannot read"),
        (("plot", "/no/such/run"), "/no/such/run/summary.json: no such file"),
        (("run", "--set", "elastic.replicate_every=sometimes"),
         'elastic.replicate_every: must be an integer >= 0 or "auto", got \'sometimes\''),
        (("run", "--set", "elastic.replicate_every=-1"), 'elastic.replicate_every: must be an integer >= 0 or "auto", got -1'),
        (("bench", "recovery", "--fault", "hung"), "--fault: got 'hung'; allowed: kill, hang, hang_in_data, hang_in_collective"),
        (("bench", "status", "--rounds", "0"), "bench status: --rounds must be >= 1, got 0"),
        (("bench", "chaos", "--checkpoint-every", "0"), "--checkpoint-every: must be >= 1"),  # was a ZeroDivisionError
        (("bench", "chaos", "--seeds", "1,a"), "--seeds: comma-separated whole numbers, got '1,a'"),
        (("bench", "chaos", "--faults", "kill,nope"), "--faults: nope: not a fault kind of the drill"),
        (("run", "--set", "elastic.stuck_after_steps=abc"), "elastic.stuck_after_steps: must be a number, got 'abc'"),
        (("run", "--set", "elastic.stuck_min_s=-1"), "elastic.stuck_min_s: must be >= 0.0, got -1.0"),
        (("run", "--set", "elastic.replicate_every=1.5"), "elastic.replicate_every: must be an integer or a string, got 1.5"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    # in this process, the command line's own entry (a process each cost about a second of a core:
    # CI's time); the way out through a real process is the test below, with the checks whose
    # answer depends on the process (a Ray this test process may be connected to)
    from elastic_zero.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-zero: error: ") and message in lines[0], err


@pytest.mark.parametrize("args, message", [
    (("run", "examples/jobs/tiny.toml", "--set", "zero.stage=5"), "zero.stage: got 5; allowed: 1, 2, 3"),
    (("bench", "chaos", "--seeds", "1,a"), "--seeds: comma-separated whole numbers, got '1,a'"),
    # a process connected to no Ray asks the machine (a connected one asks its cluster)
    (("run", "--set", "elastic.use_gpu=true"), "elastic.use_gpu: true needs GPUs, but this machine has none"),
])
def test_a_bad_argument_ends_the_process_with_exit_2_and_one_line(args, message):
    out = _run(*args, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"elastic-zero: error: {message}"), out.stderr


def test_checkpoint_ls_inspect_and_export(tmp_path):
    from elastic_zero.checkpoint import save
    from elastic_zero.zero import SGD, ZeroEngine, reshard

    engine = ZeroEngine(build_preset("gpt-tiny", seed=0), SGD(lr=0.1), stage=2)
    shards = reshard([engine.shard_state()], 2)
    save(str(tmp_path / "ck"), shards, stage=2)
    out = _run("checkpoint", "ls", str(tmp_path / "ck"), timeout=120)
    assert out.returncode == 0 and "step        0  world size 2  stage 2" in out.stdout
    out = _run("checkpoint", "inspect", str(tmp_path / "ck"), timeout=120)
    info = json.loads(out.stdout)
    assert info["world_size"] == 2 and info["layout"]["elements"] == 136960 and len(info["files"]) == 2
    out = _run("checkpoint", "export", str(tmp_path / "ck"), "--out", str(tmp_path / "w.pt"), timeout=120)
    assert out.returncode == 0, out.stderr
    weights, full = torch.load(tmp_path / "w.pt", weights_only=True), engine.full_state_dict()
    assert weights.keys() == full.keys() and all(torch.equal(weights[k], full[k]) for k in full)
    out = _run("checkpoint", "inspect", str(tmp_path / "nothing"), timeout=120)
    assert out.returncode == 2 and "no committed checkpoint" in out.stderr


@pytest.mark.long  # a bench end to end against torch's DCP; the checkpoint's own tests run in CI
def test_bench_checkpoint_json_compares_with_dcp_in_one_run():
    out = _run("bench", "checkpoint", "--preset", "gpt-tiny", "--rounds", "1", "--save-workers", "2",
               "--load-workers", "3", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for key in ("ours_sync_save_s", "ours_async_stall_s", "dcp_sync_save_s", "dcp_async_stall_s", "ours_load_s",
                "dcp_load_s", "disk_write_mb_s", "disk_read_mb_s", "save_vs_disk", "load_vs_dcp"):
        assert r[key] > 0, key
    # params and two AdamW moments, in fp32, split over 2 ranks (plus alignment padding)
    assert 1.0 <= r["bytes_per_rank"] / (136960 * 3 * 4 / 2) <= 1.02
    # a meta model at ZeRO-3 started from it: from safetensors each of 3 ranks reads its third; a
    # checkpoint is read by whole blocks of 2**20 elements, more than this model (test_export: smaller ones)
    assert r["start_safetensors_s"] > 0 and 0.3 <= r["start_safetensors_read_of_model"] <= 0.4, r
    assert r["start_checkpoint_s"] > 0 and 0.3 <= r["start_checkpoint_read_of_model"] <= 1.0, r
