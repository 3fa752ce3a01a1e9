"""`elastic-zero bench startup`: where the time to the first step goes, on an embedded local Ray.

Each round starts a fresh local Ray and runs the demo's job shape (gpt-small, 3 workers, a few
steps) through `elastic_zero.run`, then the same model and batch under an elastic Ray Train
TorchTrainer on the same Ray. elastic_zero's time is split by the run's own records:

  ray_init        ray.init() of a fresh local Ray
  coordinator     from there until the coordinator actor began (its process, imports, store)
  to_spawn        from there until it spawned the workers (its checks of the checkpoint store)
  workers_ready   from the coordinator's spawn until the last worker said hello (processes, imports,
                  the model built on each); that worker's own start by phase is printed under it
                  (worker/start_clock.py: Ray's start of it, its imports, beats, device, model, setup, hello)
  to_generation   from there until the first generation started
  generation      from the first generation's start until its first step began (process groups,
                  the engine and its buffers)
  first_step      the first optimizer step itself (rank 0)

Ray Train's is from the trainer's start (Ray already up) to its first step's end.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

from elastic_zero.observe.event_log import read_events
from elastic_zero.worker.start_clock import PHASES as START_PHASES

PHASES = ("ray_init", "coordinator", "to_spawn", "workers_ready", "to_generation", "generation", "first_step")


def startup_phases(t0: float, ray_ready: float, events: list[dict], summary: dict) -> dict:
    """The phases of one run, in seconds, from its records (pure)."""
    job_start = next(e["t"] for e in events if e["event"] == "job_start")
    spawn = next(e["t"] for e in events if e["event"] == "spawn")
    first_gen = next(e for e in events if e["event"] == "generation_start")
    ready = max(e["t"] for e in events if e["event"] == "worker_ready" and e["t"] <= first_gen["t"])
    first_step_at = summary["started_at_epoch"] + summary["time_to_first_step_s"]
    first_step_s = summary["step_time_curve"][0][1]
    phases = {"ray_init": ray_ready - t0, "coordinator": job_start - ray_ready, "to_spawn": spawn - job_start,
              "workers_ready": ready - spawn, "to_generation": first_gen["t"] - ready,
              "generation": first_step_at - first_gen["t"], "first_step": first_step_s}
    phases["total_to_first_step_done"] = first_step_at + first_step_s - t0
    return {k: round(v, 3) for k, v in phases.items()}


def _elastic_zero_round(preset: str, workers: int, work: str) -> dict:
    import ray

    from elastic_zero.api import RunConfig, run
    from elastic_zero.coordinator.actor import NAMESPACE
    from elastic_zero.job.spec import spec_from_dict

    spec = spec_from_dict({"name": "bench-startup", "model": {"preset": preset},
                           "train": {"steps": 3, "global_batch": 8 * workers, "micro_batch": 8},
                           "elastic": {"workers": workers, "min_workers": 1, "max_workers": workers}})
    t0 = time.time()
    ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False, logging_level="ERROR",
             namespace=NAMESPACE, log_to_driver=False)
    ray_ready = time.time()
    try:
        run_dir = os.path.join(work, "elastic_zero")
        result = run(spec, RunConfig(run_dir=run_dir, progress=False), started_at=t0)
        if not result.ok:
            raise RuntimeError(f"the startup run failed: {result.error}")
        summary = dict(result.metrics, started_at_epoch=t0)
        ours = startup_phases(t0, ray_ready, read_events(run_dir), summary)
        ours["worker_start_s"] = (summary.get("start") or {}).get("worker_start_s") or {}
        theirs = _ray_train_to_first_step(preset, workers, work)
    finally:
        ray.shutdown()
    return {"elastic_zero": ours, "ray_train_to_first_step_done": theirs}


def _ray_train_to_first_step(preset: str, workers: int, work: str) -> float:
    from elastic_zero.bench.ray_train_job import run_trainer

    log = os.path.join(work, "ray_train_steps.jsonl")
    config = {"preset": preset, "steps": 3, "global_batch": 8 * workers, "micro_batch": 8, "checkpoint_every": 1000,
              "log": log}
    started = time.time()
    run_trainer(config, 1, workers, os.path.join(work, "ray_train"), "bench-startup")
    with open(log) as fh:
        first = json.loads(fh.readline())
    return round(first["done"] - started, 3)


def run_startup_bench(preset: str = "gpt-small", workers: int = 3, rounds: int = 3) -> dict:
    from elastic_zero.models import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")
    if workers < 1 or rounds < 1:
        raise ValueError("need --workers >= 1 and --rounds >= 1")
    runs = []
    for _ in range(rounds):
        work = tempfile.mkdtemp(prefix="ez-startup-")
        try:
            runs.append(_elastic_zero_round(preset, workers, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    medians = {k: round(statistics.median(r["elastic_zero"][k] for r in runs), 3)
               for k in PHASES + ("total_to_first_step_done",)}
    starts = [r["elastic_zero"]["worker_start_s"] for r in runs]
    worker = {p: round(statistics.median(w[p] for w in starts if p in w), 3) for p in START_PHASES
              if any(p in w for w in starts)}
    theirs = round(statistics.median(r["ray_train_to_first_step_done"] for r in runs), 3)
    return {"preset": preset, "workers": workers, "rounds": rounds, "elastic_zero_median_s": medians,
            "last_worker_start_median_s": worker, "ray_train_to_first_step_done_median_s": theirs, "runs": runs}


def format_startup(r: dict) -> str:
    m = r["elastic_zero_median_s"]
    lines = [f"bench startup: {r['preset']}, {r['workers']} workers, embedded local Ray, medians of {r['rounds']} round(s)"]
    for phase in PHASES:
        lines.append(f"  {phase:<14} {m[phase]:7.2f} s")
        if phase == "workers_ready" and r["last_worker_start_median_s"]:
            lines.append("    the last worker's start: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in r["last_worker_start_median_s"].items()))
    lines.append(f"  {'to first step done':<14} {m['total_to_first_step_done']:7.2f} s  (Ray Train, Ray already up: "
                 f"{r['ray_train_to_first_step_done_median_s']:.2f} s)")
    return "\n".join(lines)
