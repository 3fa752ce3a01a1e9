"""A process group whose waits another thread can break.

gloo's ProcessGroup.abort() does not close its connections: a rank blocked on a live peer that has
itself given up stays blocked until the group's timeout (measured here: a recv from a rank whose
group was aborted returned only when that rank's process exited). So every wait on this group's
work goes through `wait`, which returns as soon as the work completes or `abort()` is called:
collectives signal completion through their future; send and receive, which have none, are
waited for by one helper thread per group. An abandoned operation is left to finish or time out
inside the backend, on buffers nobody reuses while it holds them (a generation's successor allocates
its own, and host_pool.py lends a host buffer's memory again only once its last holder let go).

Destroying a gloo group waits until its queued work is done, which for abandoned work means its
timeout; so an aborted group is kept alive until its timeout has passed and then let go on a
background thread, never on the thread that drops the last other reference to it.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time


class GroupAborted(RuntimeError):
    """The process group was aborted while (or before) this wait."""


class AbortableGroup:
    def __init__(self, process_group, timeout_s: float) -> None:
        self.pg = process_group
        self.timeout_s = timeout_s
        self._aborted = False
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()
        self._helper_queue: queue.SimpleQueue | None = None

    def __getattr__(self, name):  # the collectives, rank(), size(), the backend's name
        return getattr(self.pg, name)

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            waiters = list(self._waiters)
        for event in waiters:
            event.set()
        _release_later(self.pg, time.monotonic() + self.timeout_s + 1.0)
        try:
            self.pg.abort()  # whatever the backend does on its own
        except Exception:  # noqa: BLE001 - a broken group may refuse; the waits above are released either way
            pass

    def wait(self, work) -> None:
        """Wait for `work` of this group; raise GroupAborted if the group is aborted first."""
        if self._aborted:
            raise GroupAborted("the process group was aborted (the generation is being torn down)")
        done, outcome = threading.Event(), []
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send and recv have no future: a helper thread waits for them
            future = None
        if future is not None:
            if future.done():
                work.wait()  # raises the operation's own error, if any
                return
            future.add_done_callback(lambda _: done.set())
        else:
            self._helper().put((work, outcome, done))
        with self._lock:
            self._waiters.add(done)
            if self._aborted:
                done.set()
        try:
            done.wait()
        finally:
            with self._lock:
                self._waiters.discard(done)
        if future is not None and future.done():
            work.wait()
        elif outcome:
            if outcome[0] is not None:
                raise outcome[0]
        else:
            raise GroupAborted("the process group was aborted (the generation is being torn down)")

    def _helper(self) -> queue.SimpleQueue:
        with self._lock:
            if self._helper_queue is None:
                self._helper_queue = queue.SimpleQueue()
                # a daemon: one still blocked on an abandoned operation never holds up the exit
                threading.Thread(target=_wait_for_each, args=(self._helper_queue,), daemon=True,
                                 name="abortable-group-wait").start()
            return self._helper_queue


def _wait_for_each(pending: queue.SimpleQueue) -> None:
    while True:
        work, outcome, done = pending.get()
        try:
            work.wait()
            outcome.append(None)
        except Exception as exc:  # handed to the waiting thread, which raises it
            outcome.append(exc)
        done.set()


_doomed: list = []  # (when, tie-breaker, group): aborted groups waiting for their abandoned work to time out
_doomed_cv = threading.Condition()
_tie = itertools.count()
_releaser: threading.Thread | None = None


def _release_later(group, when: float) -> None:
    global _releaser
    with _doomed_cv:
        heapq.heappush(_doomed, (when, next(_tie), group))
        if _releaser is None:
            _releaser = threading.Thread(target=_release_due, daemon=True, name="abortable-group-release")
            _releaser.start()
        _doomed_cv.notify()


def _release_due() -> None:
    while True:
        with _doomed_cv:
            while not _doomed or _doomed[0][0] > time.monotonic():
                _doomed_cv.wait(timeout=None if not _doomed else max(0.0, _doomed[0][0] - time.monotonic()))
            due = [heapq.heappop(_doomed)]
        due.clear()  # the group's destructor runs here, outside the lock: it waits for its queued work
