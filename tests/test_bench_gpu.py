"""`bench gpu` without CUDA: the same bench on tiny shapes on the CPU, every figure found and
sensible. Oracles: the steps each job ran, the saves its checkpoint cadence makes, the recovery its
fault causes (the absolute times of a CPU mean nothing; a GPU's are in docs/benchmarks.md)."""

import json

import pytest

from elastic_zero.bench.gpu import format_gpu, run_gpu_bench
from elastic_zero.worker.start_clock import PHASES as START_PHASES


@pytest.mark.runtime
@pytest.mark.usefixtures("local_ray")
def test_the_gpu_bench_runs_on_the_cpu_and_finds_every_figure(tmp_path):
    # the plain job and the one with replicas left out (CI's time): their figures come from a step curve
    # as the checkpointing job's do
    partial = tmp_path / "partial.json"
    report = run_gpu_bench(("tiny",), micro_batch=2, steps=16, warmup=1, save_every=5, workdir=str(tmp_path),
                           steady=False, partial=str(partial), keep_runs=False)
    assert json.loads(partial.read_text()) == json.loads(json.dumps(report))  # kept after the last measurement
    assert report["device"].startswith("cpu (no CUDA")
    row = report["models"]["tiny"]
    for key in ("torch_step_s", "engine_stage1_step_s", "engine_stage2_step_s", "engine_stage3_step_s",
                "engine_host_copy_step_s"):
        assert 0 < row[key] < 10, (key, row[key])
    assert row["job_step_s"] is None and row["replicas_step_s"] is None
    assert row["recovery_without_standby"] is None  # run only with the steady figures
    # killed at step 6 once the save of step 5 committed: restored from it (lost: step 5 done, 6 in flight),
    # then the saves of steps 10 and 15
    # (16: the final weights' save, not counted)
    assert row["recovery"]["source"] == "checkpoint" and row["recovery"]["lost_steps"] == 1
    assert row["recovery"]["stall_s"] > 0 and "read_checkpoint" in row["recovery"]["phases_s"]
    assert len(row["save_blocking_s"]) == 2 and len(row["steps_during_write_s"]) == 2
    # the first generation's one worker is killed before its report: the first step on record is the recovery's
    assert row["time_to_first_step_s"] > 0 and "read_checkpoint" in row["first_step_phases_s"]
    # the first step on record (the recovery's) waited for the standby, the last worker ready: its start by
    # phase. The recovery waited for it too where it was still starting at the kill (tiny steps are quick)
    assert list(row["first_worker_start_s"]) == list(START_PHASES) and row["first_worker_start_s"]["imports"] > 0
    waited = row["recovery"]["worker_start_s"]
    assert waited is None or waited == row["first_worker_start_s"]
    assert ("s after the failure, started: ray" in format_gpu(report)) == (waited is not None)
    assert all(v is None or v > 0 for v in row["ratios"].values())
    assert "recovery from the checkpoint" in format_gpu(report) and "the last worker's start: ray" in format_gpu(report)
    # each job's run dir (its checkpoints, its final weights) went once its figures were read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial.json", "tiny"] and not any((tmp_path / "tiny").iterdir())


@pytest.mark.unit
def test_the_recovery_without_a_standby_is_printed_with_the_new_workers_start():
    """Where a standby took the lost worker's place (the CPU), the steady run measures the recovery once
    more without one, as one GPU has it: the line names the new worker's start by phase."""
    recovery = {"source": "checkpoint", "stall_s": 0.3, "standby_workers": 1, "to_next_step_done_s": 0.4,
                "phases_s": {"to_enter": 0.1}, "lost_steps": 1, "worker_start_s": None}
    alone = {**recovery, "standby_workers": 0, "stall_s": 2.5, "worker_start_s": {"ray": 0.6, "imports": 1.3},
             "worker_ready_after_s": 2.1}
    ms = dict.fromkeys(("torch_step_s", "engine_stage1_step_s", "engine_stage2_step_s", "engine_stage3_step_s",
                        "engine_host_copy_step_s", "job_step_s", "replicas_step_s", "auto_replicas_step_s"), 0.1)
    ratios = dict.fromkeys(("engine_vs_torch", "host_copy_vs_engine", "job_vs_engine", "replicas_vs_job",
                            "auto_replicas_vs_job"), 1.0)
    row = {**ms, "ratios": ratios, "time_to_first_step_s": 3.0, "first_step_phases_s": {}, "first_worker_start_s": None,
           "auto_cadence": None, "save_blocking_s": [], "steps_during_write_s": [], "recovery": recovery,
           "recovery_without_standby": alone}
    lines = format_gpu({"device": "cpu", "torch": "x", "micro_batch": 4, "steps": 30, "models": {"tiny": row}})
    by_standby, without = lines.splitlines()[-2:]
    assert "by a standby worker: stall 0.3 s" in by_standby and "new worker" not in by_standby
    assert without.startswith("  recovery from the checkpoint: stall 2.5 s") and without.endswith(
        "; the new worker, ready 2.1 s after the failure, started: ray 0.60 s, imports 1.30 s (without a standby, as on one GPU)")
