"""The coordinator's status record, published as a file in its node's Ray log directory and rewritten
about once a second, so that a client with only the dashboard's address reads it over HTTP through
Ray's log API (service/published_status.py) in milliseconds. Asking the coordinator itself from such a
client takes a control job (service/control.py): 3-3.7 s a call on a 2-core machine, most of it the
job's driver process starting and connecting.

The file is replaced whole (written beside it, then renamed), so a reader never sees half of one.
Building the record walks the job's events; a job whose record takes long to build publishes less
often, so that publishing never takes more than MAX_SHARE of a core.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

from elastic_zero.observe.live import status_file_name

PUBLISH_EVERY_S = 1.0  # the shortest period between two records
MAX_SHARE = 0.02  # of a core, at most, spent building and writing records


def publish_period(last_cost_s: float) -> float:
    """Seconds until the next record, after one that took `last_cost_s` to build and write."""
    return max(PUBLISH_EVERY_S, last_cost_s / MAX_SHARE)


def ray_log_dir() -> str | None:
    """This process's Ray node's log directory (what the dashboard's log API serves), None where this
    is no Ray worker (a coordinator built in a test's own process)."""
    try:
        from ray._private.worker import global_worker

        return global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - Ray's private layout moved, or no node: nothing is published
        return None


class StatusFile:
    """Writes `build()`'s record to `<log_dir>/<status_file_name(job_id)>` until stopped."""

    def __init__(self, log_dir: str, job_id: str, build: Callable[[], dict], warn: Callable[[str], None]) -> None:
        self.path = os.path.join(log_dir, status_file_name(job_id))
        self._build, self._warn = build, warn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="status-file")
        self._thread.start()

    def _run(self) -> None:
        while True:
            started = time.perf_counter()
            self.write()
            if self._stop.wait(publish_period(time.perf_counter() - started)):
                return

    def write(self, record: dict | None = None) -> None:
        """One record (`build()`'s unless given) into the file; a failure is told once, and clients
        then ask the coordinator (a control job) instead."""
        try:
            text = json.dumps(self._build() if record is None else record)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            partial = f"{self.path}.{os.getpid()}.partial"
            with open(partial, "w") as fh:
                fh.write(text)
            os.replace(partial, self.path)
        except Exception as exc:  # noqa: BLE001 - the file system, or a record that failed to build: told, never fatal
            if not self._failed:
                self._failed = True
                self._warn(f"the status file {self.path} cannot be written ({exc}); `status` over the "
                           f"dashboard's address asks the coordinator through a control job instead")

    def stop(self, final: dict | None = None) -> None:
        """No more periodic records; `final` (the job's last record) is written once the thread is done."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if final is not None:
            self.write(final)
