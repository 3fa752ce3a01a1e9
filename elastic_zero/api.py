"""The Python API: a job is a JobSpec (the same frozen dataclasses a TOML spec loads into), run
with `run(job)` on an embedded local Ray or a cluster, giving a Result. `elastic-zero run` is a
thin layer over it (run_job).

The names follow Ray Train's: ScalingConfig (how many workers, GPUs), CheckpointConfig, RunConfig
(where the outputs go, which cluster), Result (metrics, checkpoint, path, error).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from elastic_zero.spec import CheckpointSpec, DataSpec, ElasticSpec, JobSpec, ModelSpec, SpecError, TrainSpec

Job = JobSpec
ScalingConfig = ElasticSpec
CheckpointConfig = CheckpointSpec
ModelConfig, DataConfig, TrainConfig = ModelSpec, DataSpec, TrainSpec

EXIT_OK, EXIT_FAILED = 0, 1  # a bad spec raises SpecError: the CLI exits 2 with it


@dataclass(frozen=True)
class RunConfig:
    storage_path: str = "runs"  # the run's directory is storage_path/NAME-TIME, unless run_dir names it
    run_dir: str | None = None
    address: str | None = None  # a Ray cluster to join ("auto", "ray://host:10001"); default: an embedded local Ray

    def path_for(self, name: str) -> str:
        return self.run_dir or os.path.join(self.storage_path, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


@dataclass(frozen=True)
class Result:
    ok: bool
    metrics: dict  # the run's summary: final_loss, final_metrics, steps, samples, recoveries, ...
    path: str  # the run's directory: summary.json and events.jsonl
    checkpoint: str | None = None  # the newest checkpoint the job committed, if any
    error: str | None = None  # why training failed, in one line
    state_dict: dict | None = field(default=None, repr=False)  # the final fp32 weights (on success)


def run(job: JobSpec, run_config: RunConfig | None = None, *, started_at: float | None = None) -> Result:
    """Train `job` to its end. A bad job raises SpecError (a ValueError naming the field) before Ray
    starts; a failure during training gives a Result with ok=False and the error."""
    started_at = started_at or time.time()
    run_config = run_config or RunConfig()
    from elastic_zero.job import settle_steps
    from elastic_zero.preflight import preflight
    from elastic_zero.user_code import ship_by_value

    job = job.normalized()
    size = preflight(job, import_user_code=run_config.address is None)
    try:
        job = settle_steps(job, size)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    ship_by_value(job.model.factory, job.train.loss, job.data.collate)
    path = run_config.path_for(job.name)
    outcome = _run_coordinator(job, run_config.address, started_at)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as fh:
        for record in outcome["events"]:
            fh.write(json.dumps(record) + "\n")
    summary = {**outcome["summary"], "ok": outcome["ok"], "error": outcome.get("error")}
    with open(os.path.join(path, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    committed = [e["directory"] for e in outcome["events"] if e.get("event") == "checkpoint_committed"]
    return Result(ok=outcome["ok"], metrics=summary, path=path, checkpoint=committed[-1] if committed else None,
                  error=outcome.get("error"), state_dict=outcome.get("final_state") if outcome["ok"] else None)


def _run_coordinator(job: JobSpec, address: str | None, started_at: float) -> dict:
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, Coordinator, coordinator_name

    own_ray = not ray.is_initialized()
    if own_ray:
        if address:
            ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR")
        else:  # an embedded local Ray: logical CPUs for every worker the job may have
            cpus = max(os.cpu_count() or 1, job.elastic.max_workers + 1)
            ray.init(num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False, logging_level="ERROR")
    try:
        actor = ray.remote(Coordinator).options(
            name=coordinator_name(job.name), namespace=NAMESPACE, num_cpus=0, max_concurrency=16,
        ).remote(job.to_dict(), started_at)
        outcome = ray.get(actor.run.remote())
        ray.kill(actor)
    finally:
        if own_ray:
            ray.shutdown()
    return outcome


def run_job(spec: JobSpec, run_dir: str | None, address: str | None = None, final_weights: str | None = None,
            started_at: float | None = None) -> int:
    """`elastic-zero run`: the exit code, a line on stdout (success) or stderr (failure). Outputs go
    to `run_dir`, else runs/NAME-TIME (RunConfig's default)."""
    result = run(spec, RunConfig(run_dir=run_dir, address=address), started_at=started_at)
    if not result.ok:
        print(f"elastic-zero: training failed: {result.error}", file=sys.stderr)
        return EXIT_FAILED
    if final_weights:
        import torch

        torch.save(result.state_dict, final_weights)
    s = result.metrics
    extra = "".join(f", {k} {v:.4g}" for k, v in (s.get("final_metrics") or {}).items())
    print(f"done: {s['steps']} steps, final loss {s['final_loss']:.4f}{extra}, world sizes "
          f"{' -> '.join(str(n) for _, n in s['world_size_history'])}, {len(s['recoveries'])} recoveries, "
          f"{len(s['reconfigurations'])} reconfigurations; outputs in {result.path}")
    return EXIT_OK
