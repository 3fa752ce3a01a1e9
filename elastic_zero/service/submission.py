"""What a submission to the Ray Jobs API is made of, as plain values: the job id, the entrypoint,
the runtime environment, the control jobs' commands and their answers. No Ray, no network."""

from __future__ import annotations

import json
import re
import secrets
import shlex

SPEC_ENV = "ELASTIC_ZERO_SPEC"  # the job's spec, as JSON, in the entrypoint's environment
CONTROL_MARK = "ELASTIC_ZERO_CONTROL "  # the line of a control job's output that holds its answer
DEFAULT_RUNS = "~/elastic-zero/runs"  # on the cluster, where a submitted job's outputs go by default
# the working dir is uploaded to the cluster: leave out what a training repo holds that jobs do not need
DEFAULT_EXCLUDES = ("runs/", ".git/", ".venv/", "venv/", "__pycache__/", "*.pt", "*.pth", "*.safetensors",
                    "*.arrow", "*.parquet", ".ci/", "*.png")
JOB_KIND, CONTROL_KIND = "job", "control"  # metadata["elastic_zero"] of each kind of submission


def new_job_id(name: str, token: str | None = None) -> str:
    """A job's id on the cluster: its name and a random suffix (ids are never reused)."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "job"
    return f"{slug}-{token or secrets.token_hex(3)}"


def job_entrypoint(job_id: str, run_dir: str | None) -> str:
    """`elastic-zero run` on the cluster, as a module: it runs with the Python the cluster's PATH
    names, where elastic_zero is installed (the control jobs need it there too)."""
    out = run_dir or f"{DEFAULT_RUNS}/{job_id}"
    # "~" is left for the cluster's shell to expand; anything else is quoted
    out = out if re.fullmatch(r"~?[A-Za-z0-9_./-]+", out) else shlex.quote(out)
    return f"python -m elastic_zero.cli run --spec-env {SPEC_ENV} --job-id {shlex.quote(job_id)} --address auto --run-dir {out}"


def job_runtime_env(spec: dict, working_dir: str | None, excludes=()) -> dict:
    env: dict = {"env_vars": {SPEC_ENV: json.dumps(spec)}}
    if working_dir:
        env["working_dir"] = working_dir
        env["excludes"] = list(DEFAULT_EXCLUDES) + list(excludes)
    return env


CONTROL_MAIN = "import sys; from elastic_zero.service.control import main; sys.exit(main(sys.argv[1:]))"


def control_entrypoint(op: str, job_id: str, **args) -> str:
    # (-c, not -m: the package's __init__ imports control.py first, and runpy warns on every run)
    return (f"python -c {shlex.quote(CONTROL_MAIN)} {shlex.quote(op)} {shlex.quote(job_id)} "
            f"{shlex.quote(json.dumps(args))}")


def control_answer(value=None, error: str | None = None, missing: bool = False) -> str:
    """`missing`: the job has no coordinator on the cluster (unknown, or over and gone)."""
    return CONTROL_MARK + json.dumps({"ok": error is None, "value": value, "error": error, "missing": missing})


def read_control_answer(logs: str) -> dict | None:
    """The answer line of a control job's output; None when it printed none (it failed before)."""
    for line in reversed(logs.splitlines()):
        if line.startswith(CONTROL_MARK):
            return json.loads(line[len(CONTROL_MARK):])
    return None
