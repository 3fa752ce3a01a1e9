"""Start-up: the driver and the coordinator import no torch (a second of a two-core machine each,
measured by `elastic-zero bench startup`). The driver checks and sends the job without it; the
coordinator spawns its workers first and opens its store (torch's) while they start. Oracle:
sys.modules of a fresh interpreter after what each process does before its first step."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

DRIVER = """
import json, sys
from elastic_zero.cli import DEFAULT_JOB, _parser
from elastic_zero.api import RunConfig
from elastic_zero.job.preflight import preflight, settle_steps
from elastic_zero.job.spec import spec_from_dict
from elastic_zero.job.user_code import ship_by_value
import elastic_zero.driver
job = spec_from_dict(json.loads(json.dumps(DEFAULT_JOB))).normalized()
job = settle_steps(job, preflight(job))
ship_by_value(job.model.factory, job.train.loss, job.data.collate)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""

COORDINATOR = """
import sys
import elastic_zero.coordinator.actor
from elastic_zero.worker.actor import TrainingWorker
from elastic_zero.models import PRESETS
from elastic_zero.data import DataError
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("who, code", [("driver", DRIVER), ("coordinator", COORDINATOR)])
def test_what_runs_before_the_workers_start_imports_no_torch(who, code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the {who} imported {out.stdout.strip()}"
