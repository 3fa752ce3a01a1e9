"""A clean job says nothing on its actors' stderr: Ray forwards what an actor writes there to the
console of whoever called ray.init (log_to_driver), so anything the coordinator or a worker prints
reaches the user's console as noise beside the job's own lines. Oracle: Ray's per-process log files,
which hold every line an actor wrote, past the header lines Ray writes itself."""

import glob
import os
import time

import pytest
import ray

from runtime_jobs import job

pytestmark = pytest.mark.runtime


def _written_since(since: float) -> dict[str, list[str]]:
    logs = ray._private.worker._global_node.get_logs_dir_path()
    written = {}
    for path in glob.glob(os.path.join(logs, "worker-*.err")):
        if os.path.getmtime(path) >= since:
            with open(path) as fh:
                # Ray's own header: which job and actor the process serves
                written[os.path.basename(path)] = [line for line in fh.read().splitlines()
                                                   if line.strip() and not line.startswith((":job_id:", ":actor_name:"))]
    return written


def test_a_clean_job_writes_nothing_to_its_actors_stderr(tmp_path, local_ray):
    since = time.time() - 1  # mtimes are coarser than time() on some file systems
    code, summary, _, _ = job(tmp_path, "quiet", train={"steps": 3})
    assert code == 0 and summary["ok"]
    written = _written_since(since)
    assert len(written) >= 3, written  # the coordinator's and the two workers' files
    assert not any(written.values()), {name: lines for name, lines in written.items() if lines}
