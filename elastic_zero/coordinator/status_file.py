"""The coordinator's status record, published as a file in its node's Ray log directory and rewritten
about once a second, so that a client with only the dashboard's address reads it over HTTP through
Ray's log API (service/published_status.py) in milliseconds. Asking the coordinator itself from such a
client takes a control job (service/control.py): 3-3.7 s a call on a 2-core machine, most of it the
job's driver process starting and connecting.

Each record is written to a file of its own beside the published one, then renamed over it, so a reader
never sees half of one. Building the record walks the job's events; a job whose record takes long to
build publishes less often, so that publishing takes at most MAX_SHARE of a core, and never less often
than every LONGEST_PERIOD_S (the reader's staleness bound is three of those).
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import threading
import time
from typing import Callable

from elastic_zero.observe.live import status_file_name

PUBLISH_EVERY_S = 1.0  # the shortest period between two records
LONGEST_PERIOD_S = 10.0  # the longest (service/published_status.py's STALE_S is three of these)
MAX_SHARE = 0.02  # of a core, at most, spent building and writing records


def publish_period(last_cpu_s: float) -> float:
    """Seconds until the next record, after one that took `last_cpu_s` of this thread's CPU to build and
    write (CPU, not wall: waits for the GIL or the job's lock cost no core)."""
    return min(LONGEST_PERIOD_S, max(PUBLISH_EVERY_S, last_cpu_s / MAX_SHARE))


def ray_log_dir() -> str | None:
    """This process's Ray node's log directory (what the dashboard's log API serves), None where this
    is no Ray worker (a coordinator built in a test's own process)."""
    try:
        from ray._private.worker import global_worker

        return global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - Ray's private layout moved, or no node: nothing is published
        return None


def remove_orphans(directory: str, keep: str) -> list[str]:
    """The status files in `directory` (one node's) whose coordinator process has ended, removed: no
    reader takes a record but the live coordinator's (service/published_status.py), and a long-lived
    cluster's log directory would keep one per job it ever ran. Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*.status.json")):
        try:
            with open(path) as fh:
                pid = (json.load(fh).get("coordinator") or {}).get("pid")
        except (OSError, ValueError, AttributeError):  # unreadable, or not a record: not ours to judge
            continue
        if path == keep or not isinstance(pid, int) or _alive(pid):
            continue
        try:
            os.remove(path)
            removed.append(path)
        except OSError:  # removed by another coordinator's sweep, or not ours to remove: it is never read
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class StatusFile:
    """Writes `build()`'s record to `<log_dir>/<status_file_name(job_id)>` from start() until stop()."""

    def __init__(self, log_dir: str, job_id: str, build: Callable[[], dict], warn: Callable[[str], None]) -> None:
        self.path = os.path.join(log_dir, status_file_name(job_id))
        self._build, self._warn = build, warn
        self._lock = threading.Lock()  # start() against stop(): a stopped publisher never starts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            for left in glob.glob(glob.escape(self.path) + ".*.partial"):  # a predecessor killed mid-write
                try:
                    os.remove(left)
                except OSError:  # gone already, or kept: a stray .partial is never read, and each write makes its own
                    pass
            remove_orphans(os.path.dirname(self.path), keep=self.path)
            self._thread = threading.Thread(target=self._run, daemon=True, name="status-file")
            self._thread.start()

    def _run(self) -> None:
        while True:
            started = time.thread_time()
            self.write()
            if self._stop.wait(publish_period(time.thread_time() - started)):
                return

    def write(self, record: dict | None = None) -> None:
        """One record (`build()`'s unless given) into the file; a failure is told once, and clients
        then ask the coordinator (a control job) instead."""
        partial = None
        try:
            text = json.dumps(self._build() if record is None else record)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".", suffix=".partial",
                                           dir=os.path.dirname(self.path))
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(partial, self.path)
        except Exception as exc:  # noqa: BLE001 - the file system, or a record that failed to build: told, never fatal
            if partial is not None:
                try:
                    os.remove(partial)
                except OSError:  # the failure is told below; a stray .partial is never read
                    pass
            self._tell_once(f"the status file {self.path} cannot be written ({exc}); `status` over the "
                            f"dashboard's address asks the coordinator through a control job instead")

    def _tell_once(self, message: str) -> None:
        if self._failed:
            return
        self._failed = True
        try:
            self._warn(message)
        except Exception:  # noqa: BLE001 - the job's log is going too: nothing more to tell
            pass

    def stop(self, final: dict | None) -> None:
        """No more periodic records (nor a start after this). `final`, the job's last record, is written
        once the periodic thread is done; None (it could not be built): the file goes, so that clients
        ask the coordinator rather than read a record that still says the job runs."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join()
        if final is not None:
            self.write(final)
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:  # never written
            pass
        except OSError as exc:  # its last record says the job runs: readers drop it once it is 30 s old
            self._tell_once(f"the status file {self.path} cannot be removed ({exc}); `status` over the "
                            f"dashboard's address may show the job running for 30 s after its end")
