"""The Python API: a job is a JobSpec (the same frozen dataclasses a TOML spec loads into), run
with `run(job)` on an embedded local Ray or a cluster, giving a Result. `elastic-zero run` is a
thin layer over it (run_job).

The names follow Ray Train's: ScalingConfig (how many workers, GPUs), CheckpointConfig, RunConfig
(where the outputs go, which cluster), Result (metrics, checkpoint, path, error).
"""

from __future__ import annotations

import os
import sys
import time
import functools
from dataclasses import dataclass

from elastic_zero.driver import drive
from elastic_zero.job.prepare import prepare_run, seal
from elastic_zero.job.spec import (CheckpointSpec, DataSpec, ElasticSpec, EvalSpec, JobSpec, ModelSpec,
                                   TrackingSpec, TrainSpec)

Job = JobSpec
ScalingConfig = ElasticSpec
CheckpointConfig = CheckpointSpec
ModelConfig, DataConfig, TrainConfig = ModelSpec, DataSpec, TrainSpec
EvalConfig, TrackingConfig = EvalSpec, TrackingSpec

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2  # a bad spec raises SpecError: the CLI exits 2 with it


@dataclass(frozen=True)
class RunConfig:
    storage_path: str = "runs"  # the run's directory is storage_path/NAME-TIME, unless run_dir names it
    run_dir: str | None = None
    address: str | None = None  # a Ray cluster to join ("auto", "HOST:6379"); default: an embedded local Ray
    progress: bool = True  # a progress line (a bar on a terminal) and a line per event, on stderr
    worker_logs: bool = False  # forward the workers' own output (and Ray's worker-death notes) to this console

    def path_for(self, name: str) -> str:
        path = self.run_dir or os.path.join(self.storage_path, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        return os.path.abspath(os.path.expanduser(path))


@dataclass(frozen=True)
class Result:
    ok: bool
    metrics: dict  # the run's summary: final_loss, final_metrics, steps, samples, recoveries, ...
    path: str  # the run's directory: summary.json and events.jsonl
    checkpoint: str | None = None  # the newest checkpoint the job committed, if any
    error: str | None = None  # why training failed, in one line
    final_checkpoint: str | None = None  # the checkpoint of the final weights (a URI), on success
    bad_input: bool = False  # it failed on what the spec asks and the cluster cannot give (a field named in error)

    @functools.cached_property
    def state_dict(self) -> dict | None:
        """The final fp32 weights, read from final_checkpoint when first asked (None if the job
        failed). Up to STATE_DICT_LIMIT_BYTES (4 GiB); a larger model raises ValueError: export it
        (elastic_zero.checkpoint.export.export, or `elastic-zero export`)."""
        if not self.ok or self.final_checkpoint is None:
            return None
        from elastic_zero.checkpoint.export import load_state_dict

        return load_state_dict(self.final_checkpoint)


def run(job: JobSpec, run_config: RunConfig | None = None, *, started_at: float | None = None,
        job_id: str | None = None) -> Result:
    """Train `job` to its end (or until it is stopped). A bad job raises SpecError (a ValueError
    naming the field) before Ray starts; a failure during training gives a Result with ok=False and
    the error. `job_id` names the job on the cluster (default: its name)."""
    started_at = started_at or time.time()
    run_config = run_config or RunConfig()
    path = run_config.path_for(job.name)
    job = prepare_run(job, path, embedded=run_config.address is None)
    outcome = drive(job, seal(job), job_id or job.name, path, run_config, started_at)
    return Result(ok=outcome["ok"], metrics=outcome["summary"], path=path, checkpoint=outcome.get("checkpoint"),
                  error=outcome.get("error"), final_checkpoint=outcome.get("final_checkpoint") if outcome["ok"] else None,
                  bad_input=bool(outcome.get("bad_input")))


def run_job(spec: JobSpec, run_config: RunConfig, final_weights: str | None = None, started_at: float | None = None,
            job_id: str | None = None) -> int:
    """`elastic-zero run`: the exit code, a line on stdout (success) or stderr (failure)."""
    result = run(spec, run_config, started_at=started_at, job_id=job_id)
    if not result.ok and result.bad_input:  # the spec asks what this cluster cannot give: as a bad spec
        print(f"elastic-zero: {result.error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not result.ok:
        print(f"elastic-zero: training failed: {result.error}", file=sys.stderr)
        return EXIT_FAILED
    if final_weights and not result.final_checkpoint:  # stopped before its first step: no weights to write
        print(f"elastic-zero: --final-weights: the job ended with no final checkpoint ({result.path})", file=sys.stderr)
        return EXIT_FAILED
    if final_weights:
        from elastic_zero.checkpoint.export import export

        fmt = "safetensors" if final_weights.endswith(".safetensors") else "torch"
        try:
            export(result.final_checkpoint, final_weights, fmt)
        except (OSError, ValueError) as exc:
            print(f"elastic-zero: --final-weights: {str(exc).splitlines()[0]}", file=sys.stderr)
            return EXIT_FAILED
    s = result.metrics
    if s.get("note"):  # nothing was trained (a resume at or past the last step): the line says why
        print(f"{s['note']}; outputs in {result.path}")
        return EXIT_OK
    extra = "".join(f", {k} {v:.4g}" for k, v in (s.get("final_metrics") or {}).items())
    loss = "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    how = f"stopped at step {s['stopped_at_step']}" if "stopped_at_step" in s else "done"
    print(f"{how}: {s['steps']} steps, final loss {loss}{extra}, world sizes "
          f"{' -> '.join(str(n) for _, n in s['world_size_history'])}, {len(s['recoveries'])} recoveries, "
          f"{len(s['reconfigurations'])} reconfigurations; outputs in {result.path}")
    return EXIT_OK
