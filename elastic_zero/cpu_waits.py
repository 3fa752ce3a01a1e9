"""How long a process waited for a CPU while it was ready to run, read from Linux's schedstat, the
standard library only (a worker's beat process loads it by path, as a script of its own:
wire/heartbeats.py). A starved worker stands as still as a hung one; this tells them apart
(plan/stuck.py).
"""

from __future__ import annotations

import os
import time

STILL_BEFORE_READ_S = 0.3  # a worker's training stood still this long: its beats tell its wait for a CPU


def run_queue_wait_ms(pid: int) -> int:
    """How long the threads of process `pid` have waited, ready to run, for a CPU: their sum, in ms,
    from Linux's schedstat (0 where it cannot be read: the process gone, another system)."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total // 1_000_000


class StillnessMeter:
    """How long a worker's process waited for a CPU while its training stood still (ms), for its beats.

    A starved worker stands as still as a hung one (plan/stuck.py takes this wait off its stillness).
    Which of its threads waits is not the training thread's alone: that one may be blocked on the GIL
    held by a thread that waits for a core; so the wait of all its threads is read, and each interval
    counts at most its own length (the process wanted a CPU then, and had none). Read only once the
    training stood still STILL_BEFORE_READ_S (a read of all threads costs about half a millisecond),
    so the first such fraction of a stillness is never counted: it can only make a starved worker
    look stuck that much sooner, not a hung one later. Where /proc cannot be read, 0: judged as before."""

    def __init__(self, pid: int, clock=time.monotonic, read=run_queue_wait_ms) -> None:
        self._pid, self._clock, self._read = pid, clock, read
        self._position, self._since, self._last, self._waited_ms = None, 0.0, None, 0

    def __call__(self, progress: tuple) -> int:
        """`progress`: the board as read for this beat (ProgressBoard.read)."""
        now = self._clock()
        if progress != self._position:  # training moved: a new stillness, if any, starts here
            self._position, self._since, self._last, self._waited_ms = tuple(progress), now, None, 0
        elif now - self._since >= STILL_BEFORE_READ_S:
            waited = self._read(self._pid)
            if self._last is not None:
                wait_ms, interval_ms = waited - self._last[1], (now - self._last[0]) * 1000
                self._waited_ms += max(0.0, min(wait_ms, interval_ms))
            self._last = (now, waited)
        return round(self._waited_ms)
