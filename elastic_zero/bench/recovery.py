"""`elastic-zero bench recovery`: kill one of N workers mid-run, here and in Ray Train, in one run.

elastic_zero: the survivors go on from the buddy replicas; a replacement joins later (its join is
the scale-up stall). Ray Train: an elastic TorchTrainer (ScalingConfig(num_workers=(min, max)),
FailureConfig, a checkpoint every few steps) restarts its worker group from the last checkpoint.
Both train the same preset, data and global batch; both times run from the moment the killed
process records its death to the next completed optimizer step.
"""

from __future__ import annotations

import json
import os
import tempfile

from elastic_zero.models import PRESETS


def _elastic_zero(preset, workers, steps, kill_step, micro_batch, work_dir) -> dict:
    from elastic_zero.api import RunConfig, run_job
    from elastic_zero.job.spec import spec_from_dict

    spec = spec_from_dict({
        "name": "bench-recovery",
        "model": {"preset": preset},
        "train": {"steps": steps, "global_batch": micro_batch * workers, "micro_batch": micro_batch},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "elastic": {"workers": workers, "min_workers": 1, "max_workers": workers},
        "faults": [{"at_step": kill_step, "action": "kill", "rank": 1}],
    })
    run_dir = os.path.join(work_dir, "elastic_zero")
    if run_job(spec, RunConfig(run_dir=run_dir, progress=False)) != 0:
        raise RuntimeError("the elastic_zero run failed; see " + run_dir)
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    (rec,) = summary["recoveries"]
    ups = [c for c in summary["reconfigurations"] if c["to"] > c["from"]]
    return {"recovery_s": rec["to_next_step_done_s"], "recomputed_steps": rec["recomputed_steps"],
            "lost_steps": rec["lost_steps"], "scale_up_stall_s": ups[0]["stall_s"] if ups else None,
            "step_time_s_median": summary["step_time_s_median"],
            "time_to_first_step_s": summary["time_to_first_step_s"]}


def _ray_train(preset, workers, steps, kill_step, micro_batch, checkpoint_every, work_dir) -> dict:
    from elastic_zero.bench.ray_train_job import run_trainer

    log, marker = os.path.join(work_dir, "ray_train_steps.jsonl"), os.path.join(work_dir, "ray_train_killed")
    config = {"preset": preset, "steps": steps, "kill_step": kill_step, "micro_batch": micro_batch,
              "global_batch": micro_batch * workers, "checkpoint_every": checkpoint_every, "log": log,
              "marker": marker}
    run_trainer(config, 1, workers, os.path.join(work_dir, "ray_train"), "bench-recovery")
    with open(marker) as fh:
        killed_at = float(fh.read())
    records = [json.loads(line) for line in open(log)]
    killed_attempt = [r for r in records if r["done"] <= killed_at][-1]["attempt"]
    first = [r for r in records if r["attempt"] == killed_attempt]
    after = [r for r in records if r["attempt"] != killed_attempt]  # the restarted worker group
    before = {r["step"] for r in first}
    times = sorted(b["done"] - a["done"] for a, b in zip(records, records[1:])
                   if b["step"] == a["step"] + 1 and b["done"] < killed_at)
    return {"recovery_s": after[0]["done"] - killed_at,
            "recomputed_steps": len({r["step"] for r in after} & before),
            "step_time_s_median": times[len(times) // 2] if times else None}


def run_recovery_bench(preset: str = "gpt-small", workers: int = 3, steps: int = 24, kill_step: int = 8,
                       micro_batch: int = 8, checkpoint_every: int = 5) -> dict:
    import ray

    if workers < 2 or not 0 < kill_step < steps:
        raise ValueError("need --workers >= 2 and 0 < --kill-step < --steps")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")
    work_dir = tempfile.mkdtemp(prefix="elastic-zero-bench-")
    ray.init(num_cpus=workers + 2, include_dashboard=False, logging_level="ERROR", namespace="elastic_zero")
    try:
        ours = _elastic_zero(preset, workers, steps, kill_step, micro_batch, work_dir)
        theirs = _ray_train(preset, workers, steps, kill_step, micro_batch, checkpoint_every, work_dir)
    finally:
        ray.shutdown()
    return {
        "preset": preset, "workers": workers, "kill_step": kill_step, "checkpoint_every": checkpoint_every,
        "elastic_zero_recovery_s": ours["recovery_s"],
        "ray_train_recovery_s": theirs["recovery_s"],
        "ratio": ours["recovery_s"] / theirs["recovery_s"],
        "elastic_zero_recomputed_steps": ours["recomputed_steps"],
        "ray_train_recomputed_steps": theirs["recomputed_steps"],
        "elastic_zero_lost_steps": ours["lost_steps"],
        "scale_up_stall_s": ours["scale_up_stall_s"],
        "elastic_zero_step_time_s_median": ours["step_time_s_median"],
        "ray_train_step_time_s_median": theirs["step_time_s_median"],
        "elastic_zero_time_to_first_step_s": ours["time_to_first_step_s"],
    }


def format_recovery(r: dict) -> str:
    return "\n".join([
        f"bench recovery: {r['preset']}, {r['workers']} CPU workers, rank 1 killed at step {r['kill_step']}",
        f"  elastic_zero  kill -> next step done {r['elastic_zero_recovery_s']:.3f} s, "
        f"recomputed steps {r['elastic_zero_recomputed_steps']} (completed steps lost {r['elastic_zero_lost_steps']})",
        f"  Ray Train     kill -> next step done {r['ray_train_recovery_s']:.3f} s, "
        f"recomputed steps {r['ray_train_recomputed_steps']} (checkpoint every {r['checkpoint_every']} steps)",
        f"  ratio {r['ratio']:.3f};  scale-up stall {r['scale_up_stall_s']} s",
    ])
