"""When a worker's node came up: its parent raylet's start (worker/node_age.py). Oracle: a process
named raylet started here, whose child asks."""

import subprocess
import time

from elastic_zero.testing.local_cluster import descendants
from elastic_zero.worker.node_age import raylet_started_at


def test_a_child_of_a_raylet_reads_its_start_and_any_other_process_reads_none():
    started = time.time()
    # argv[0] "raylet", as Ray starts it, and a child below it
    parent = subprocess.Popen(["bash", "-c", "exec -a raylet bash -c 'sleep 30 & wait'"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(parent.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (child,) = descendants(parent.pid)
        up = raylet_started_at(child)
        # to the clock's tick (10 ms): the raylet started after `started`, and has by now
        assert up is not None and started - 0.02 <= up <= time.time(), (started, up)
    finally:
        for pid in descendants(parent.pid):
            subprocess.run(["kill", "-9", str(pid)])
        parent.kill()
        parent.wait()
    assert raylet_started_at() is None  # pytest's parent is no raylet
