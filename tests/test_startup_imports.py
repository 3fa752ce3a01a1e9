"""Start-up: the driver and the coordinator import no torch (a second of a two-core machine each,
measured by `elastic-zero bench startup`). The driver checks and sends the job without it, its
checkpoint store probed through the torch-free catalog; the coordinator probes that store too, and
its rendezvous store is served by its relay in Python (store_server.py), which it uses as the job
runs. Oracle: sys.modules of a fresh interpreter after what each process does."""

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
import tempfile
job = spec_from_dict({**json.loads(json.dumps(DEFAULT_JOB)), "checkpoint": {"uri": tempfile.mkdtemp()}}).normalized()
job = settle_steps(job, preflight(job))
ship_by_value(job.model.factory, job.train.loss, job.data.collate)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""

COORDINATOR = """
import sys, tempfile
import elastic_zero.coordinator.actor
from elastic_zero.checkpoint import list_checkpoints, open_store, probe_writable, restore_candidates
root = tempfile.mkdtemp()
probe_writable(root)  # where the job writes its final weights, checked before the workers are spawned
assert list_checkpoints(*open_store(root)) == [] and restore_candidates(*open_store(root)) == []
from elastic_zero.worker.actor import TrainingWorker
from elastic_zero.models import PRESETS
from elastic_zero.data import DataError
from elastic_zero.wire.rendezvous import RendezvousServer, new_secret
server = RendezvousServer("127.0.0.1", new_secret(), 10)  # the job's store, served by its relay
server.store.set("g0/over", "abort")
assert server.store.compare_set("g0/over", "", "ended") == b"abort" and server.store.check(["g0/over"])
server.close()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("who, code", [("driver", DRIVER), ("coordinator", COORDINATOR)])
def test_what_runs_before_the_workers_start_imports_no_torch(who, code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the {who} imported {out.stdout.strip()[:300]}"
