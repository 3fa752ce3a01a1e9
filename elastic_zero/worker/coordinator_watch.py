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

import datetime
import threading
import time
from typing import Callable

NEVER_SET = "coordinator/watch"  # a key nobody sets: waiting for it ends only when the store goes
WAIT_S = 24 * 3600.0  # one wait's length; a wait that times out (the store alive) is made again


class CoordinatorWatch:
    def __init__(self, store, wait_s: float, on_lost: Callable[[], None], on_given_up: Callable[[], None]) -> None:
        """`store`: the job's store (a client or a StoreLink: it is cloned, the wait blocks the connection)."""
        self._wait_s, self._on_lost, self._on_given_up = wait_s, on_lost, on_given_up
        self._cond = threading.Condition()
        self._store = store.clone()
        self._lost_at: float | None = None  # monotonic; None: the coordinator is there
        self._epoch = 0  # taken over this many times: a watch of an earlier store ends quietly
        self._start(self._store, 0)

    @property
    def lost(self) -> bool:
        with self._cond:
            return self._lost_at is not None

    def taken_over(self, store) -> None:
        """A replacement coordinator took this worker over: watch its store from now on."""
        clone = store.clone()
        with self._cond:
            self._epoch += 1
            self._lost_at, self._store = None, clone
            epoch = self._epoch
            self._cond.notify_all()
        self._start(clone, epoch)

    def _start(self, store, epoch: int) -> None:
        threading.Thread(target=self._watch, args=(store, epoch), daemon=True, name="coordinator-watch").start()

    def _watch(self, store, epoch: int) -> None:
        import torch.distributed as dist

        while True:
            started = time.monotonic()
            try:
                store.wait([NEVER_SET], datetime.timedelta(seconds=WAIT_S))
            except dist.DistError:
                if time.monotonic() - started >= WAIT_S * 0.99:
                    store = store.clone()  # the wait timed out, the store alive: again, on a connection in step
                    continue
            break  # (a key nobody sets was set: nothing sensible to watch any more)
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
