"""One home for preparing a job, wherever it is launched: the Python API and `elastic-zero run`
(prepare_run, then sealed for Ray: seal) and a submission to a cluster (prepare_submission). The
driver only does Ray's part.

Each step raises SpecError naming the field, before anything starts or is sent.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from elastic_zero.job.spec import JobSpec, SpecError

# where a job with no checkpoint.uri writes its final weights: its run directory (on a cluster of
# several nodes, that directory must be shared, or the job must name a checkpoint.uri they all reach)
FINAL_CHECKPOINTS = "checkpoints"


def prepare_run(job: JobSpec, run_dir: str, embedded: bool) -> JobSpec:
    """The job as its driver runs it: normalized, checked before Ray starts, its steps settled, the
    user's functions shipped by value where their code is not installed, its final weights given a
    place. `embedded`: on an embedded Ray, whose workers share this Python (its user code, its
    torch): the user's functions are imported here, and MLflow's default store is ./mlruns."""
    from elastic_zero.job.preflight import preflight, settle_steps
    from elastic_zero.job.user_code import ship_by_value

    job = job.normalized()
    size = preflight(job, import_user_code=embedded)
    try:
        job = settle_steps(job, size)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    ship_by_value(*(value for _, value in job.user_functions()))
    if "mlflow" in job.tracking.backends and job.tracking.mlflow_uri is None and embedded:
        # where it was launched (on a cluster: the run directory's, coordinator/tracking)
        job = replace(job, tracking=replace(job.tracking, mlflow_uri=os.path.abspath("mlruns")))
    if job.checkpoint.uri is None:  # the final weights are a checkpoint the workers write: here, then
        job = replace(job, checkpoint=replace(job.checkpoint, uri=os.path.join(run_dir, FINAL_CHECKPOINTS)))
    return job


def seal(job: JobSpec) -> dict:
    """The spec's tables as the coordinator takes them, every value that is not plain data sealed
    (job/sealed.py): before Ray starts, so that one that cannot be pickled is a SpecError."""
    from elastic_zero.job.sealed import sealed_tables

    return sealed_tables(job.to_dict())


def prepare_submission(job: JobSpec) -> dict:
    """The spec's tables as a submission carries them (JSON, to `elastic-zero run` on the cluster).
    A function must be named 'pkg.module:fn' (found in the working dir there), and every value must
    be plain data: one that is not is a SpecError naming its field."""
    job = job.normalized()
    for where, value in job.user_functions():
        if callable(value):
            raise SpecError(f"{where}: a submitted job names its functions as 'pkg.module:fn' (found in the "
                            f"working dir on the cluster), not as Python objects")
    spec = job.to_dict()
    for section, table in spec.items():
        for key, value in (table.items() if isinstance(table, dict) else [(None, table)]):
            where = f"{section}.{key}" if key is not None else section
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise SpecError(f"{where}: a submitted job's values must be plain data (strings, numbers, "
                                f"lists, tables), as in a TOML spec ({exc})") from None
    return spec
