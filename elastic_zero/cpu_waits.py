"""How long a process waited for a CPU while it was ready to run, read from Linux's schedstat, the
standard library only (a worker's beat process loads it by path, as a script of its own:
wire/heartbeats.py). A starved worker stands as still as a hung one; this tells them apart
(plan/stuck.py).
"""

from __future__ import annotations

import os
import time

STILL_BEFORE_READ_S = 0.3  # a worker's training stood still this long: its beats tell its wait for a CPU
MAX_KEPT_FILES = 256  # threads beyond these are read as before, opened and closed each time


class RunQueueWaits:
    """How long the threads of process `pid` have waited, ready to run, for a CPU: their sum, in ms,
    from Linux's schedstat (0 where it cannot be read: the process gone, another system).

    Each thread's file is kept open and read again in place: a Ray worker has about forty threads,
    and opening forty files at every read cost its beat process 0.5 ms, where reading them in place
    costs 0.07 ms (a beat process reads them up to ten times a second, on the cores its worker trains
    on). The threads are listed at each read: one begun since is opened, one ended is closed."""

    def __init__(self, pid: int) -> None:
        self._tasks = f"/proc/{pid}/task/"
        self._files: dict[str, int] = {}  # thread id -> its schedstat, open

    def __call__(self) -> int:
        try:
            threads = os.listdir(self._tasks)
        except OSError:  # the process is gone
            self.close()
            return 0
        for ended in self._files.keys() - set(threads):
            os.close(self._files.pop(ended))
        total = 0
        for tid in threads:
            try:
                total += self._wait_ns(tid)
            except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                if tid in self._files:
                    os.close(self._files.pop(tid))
        return total // 1_000_000

    def _wait_ns(self, tid: str) -> int:
        """One thread's wait (ns), from its file kept open where there is room for it."""
        fd = self._files.get(tid)
        if fd is None:
            fd = os.open(f"{self._tasks}{tid}/schedstat", os.O_RDONLY)
            if len(self._files) >= MAX_KEPT_FILES:
                with open(fd, "rb") as f:  # (closes it)
                    return int(f.read().split()[1])
            self._files[tid] = fd
        return int(os.pread(fd, 128, 0).split()[1])

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


def run_queue_wait_ms(pid: int) -> int:
    """RunQueueWaits read once: the threads of `pid` opened, read and closed."""
    waits = RunQueueWaits(pid)
    try:
        return waits()
    finally:
        waits.close()


class StillnessMeter:
    """How long a worker's process waited for a CPU while its training stood still (ms), for its beats.

    A starved worker stands as still as a hung one (plan/stuck.py takes this wait off its stillness).
    Which of its threads waits is not the training thread's alone: that one may be blocked on the GIL
    held by a thread that waits for a core; so the wait of all its threads is read, and each interval
    counts at most its own length (the process wanted a CPU then, and had none). Read only once the
    training stood still STILL_BEFORE_READ_S (a read of all threads costs about 0.07 ms: RunQueueWaits),
    so the first such fraction of a stillness is never counted: it can only make a starved worker
    look stuck that much sooner, not a hung one later. Where /proc cannot be read, 0: judged as before."""

    def __init__(self, pid: int, clock=time.monotonic, read=None) -> None:
        """`read`: () -> the process's wait so far in ms (default: RunQueueWaits(pid))."""
        self._clock, self._read = clock, read or RunQueueWaits(pid)
        self._position, self._since, self._last, self._waited_ms = None, 0.0, None, 0

    def __call__(self, progress: tuple) -> int:
        """`progress`: the board as read for this beat (ProgressBoard.read)."""
        now = self._clock()
        if progress != self._position:  # training moved: a new stillness, if any, starts here
            self._position, self._since, self._last, self._waited_ms = tuple(progress), now, None, 0
        elif now - self._since >= STILL_BEFORE_READ_S:
            waited = self._read()
            if self._last is not None:
                wait_ms, interval_ms = waited - self._last[1], (now - self._last[0]) * 1000
                self._waited_ms += max(0.0, min(wait_ms, interval_ms))
            self._last = (now, waited)
        return round(self._waited_ms)
