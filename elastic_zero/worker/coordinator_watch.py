"""A worker's watch over its coordinator: it notices the coordinator's loss at once, and how long the
worker then waits for a replacement to take it over.

The coordinator's relay serves the job's store and ends with the coordinator's process (its stdin
closes: wire/rendezvous.py). This watch keeps one store connection waiting for a key nobody sets;
the relay's end closes it, and the wait fails within milliseconds, with no traffic while all is
well (at 1,024 workers, a poll a second would be a thousand requests a second at the relay).

On the loss, `on_lost()` runs (the worker stops at its next safe point, its shard and replicas in
memory). A replacement coordinator takes the worker over within `wait_s` (`taken_over()`, with the
replacement's store to watch from then on); otherwise `on_given_up()` runs: the worker ends, and the
job, if a coordinator comes back later, resumes from its latest checkpoint."""

from __future__ import annotations

import threading
import time
from typing import Callable

NEVER_SET = "coordinator/watch"  # a key nobody sets: waiting for it ends only when the store goes
WAIT_S = 24 * 3600.0  # one wait's length; a wait that times out (the store alive) is made again
REACH_TRIES, REACH_GAP_S = 3, 1.0  # a store that did not answer (not refused): tried again so often, so far apart


class CoordinatorWatch:
    def __init__(self, connect: Callable[[], object], wait_s: float, on_lost: Callable[[], None],
                 on_given_up: Callable[[], None]) -> None:
        """`connect()`: a new connection to the coordinator's store whose get() waits for a key (a
        wire/store_client.StoreClient: no torch, whose client prints a C++ trace when a store goes)."""
        self._wait_s, self._on_lost, self._on_given_up = wait_s, on_lost, on_given_up
        self._cond = threading.Condition()
        self._lost_at: float | None = None  # monotonic; None: the coordinator is there
        self._epoch = 0  # taken over this many times: a watch of an earlier store ends quietly
        self._start(connect, 0)

    @property
    def lost(self) -> bool:
        with self._cond:
            return self._lost_at is not None

    def hold(self) -> None:
        """A replacement is taking the worker over: no giving up while it does (taken_over() follows)."""
        with self._cond:
            self._epoch += 1
            self._lost_at = None
            self._cond.notify_all()

    def taken_over(self, connect: Callable[[], object]) -> None:
        """A replacement coordinator took this worker over: watch its store (`connect`) from now on."""
        with self._cond:
            self._epoch += 1
            self._lost_at = None
            epoch = self._epoch
            self._cond.notify_all()
        self._start(connect, epoch)

    def _start(self, connect, epoch: int) -> None:
        threading.Thread(target=self._watch, args=(connect, epoch), daemon=True, name="coordinator-watch").start()

    def _watch(self, connect, epoch: int) -> None:
        quick_ends = 0  # waits in a row that ended at once: a store that admits and drops is gone too
        while quick_ends < REACH_TRIES:
            conn = _reach(connect)
            if conn is None:
                break  # the store is gone, and the coordinator with it
            started = time.monotonic()
            try:
                conn.get(NEVER_SET)
                break  # (a key nobody sets was set: nothing sensible to watch any more)
            except OSError:  # closed or reset (or a wait that timed out): the store gone, unless it answers anew
                conn.close()
            quick_ends = quick_ends + 1 if time.monotonic() - started < REACH_GAP_S else 0
        with self._cond:
            if epoch != self._epoch:
                return  # the worker follows another coordinator by now
            self._lost_at = time.monotonic()
        self._on_lost()
        with self._cond:
            deadline = self._lost_at + self._wait_s
            while epoch == self._epoch and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if epoch != self._epoch:
                return
        self._on_given_up()


def _reach(connect):
    """A new connection to the store, or None where it is gone: refused at once (nothing listens where
    the relay did: its process ended), or no answer REACH_TRIES times (a reset or a timeout may be
    the network's, the store alive)."""
    for attempt in range(REACH_TRIES):
        try:
            return connect()
        except ConnectionRefusedError:
            return None
        except OSError:
            if attempt + 1 < REACH_TRIES:
                time.sleep(REACH_GAP_S)
    return None
