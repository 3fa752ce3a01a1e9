"""Which generation a worker is in, and the rule that keeps generations apart.

The rule: an abort names its generation and reaches nothing of another. An abort of generation g
may come early (before the worker entered g: it is kept and seen at entry), on time, or late (after
the worker entered g + 1: it is dropped). Entering a generation closes the one it leaves: when that
one ended aborted (told here, or by its end key, which the coordinator writes before it starts
another: the caller reads it), its groups are aborted and the work still in flight on them is
forgotten (the engine's gathers after the last step, say), so no wait of the next generation ever
meets a group of an aborted one. Seen without the rule: a worker finished the last step, a peer died
in the final save, the abort reached the finished worker's groups, and the recovery's first wait on
a gather launched by that last step raised GroupAborted: the job failed with every worker alive.

Every call holds the gate's lock, so its callbacks run atomically with respect to each other (an
abort of the generation being entered waits until the entry is done, and then reaches it).
"""

from __future__ import annotations

import threading
from typing import Callable

from elastic_zero.wire.generation_ends import was_aborted


class GenerationGate:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.number = -1  # the generation entered last (-1: none yet)
        self.aborted = threading.Event()  # the current generation was aborted
        self.groups: dict = {}  # the current generation's process groups, by role
        self.building: threading.Event | None = None  # set when the groups being built are ready or given up
        self._aborted_upto = -1  # the newest generation an abort came for

    def enter(self, number: int, store, settle: Callable[[bool], None]) -> None:
        """Enter generation `number`, leaving the current one. The one left is over: its end key in
        the job's `store` says whether it was aborted, even where the abort itself has not reached
        this worker yet. `settle(stale)` runs under the lock, once the groups left are dropped:
        `stale` says they were aborted, and the work in flight on them must be forgotten, never
        waited for."""
        if number <= self.number:
            raise ValueError(f"generation {number} entered after generation {self.number}")
        left_aborted = self.number >= 0 and was_aborted(store, self.number)
        with self.lock:
            stale = left_aborted or self.aborted.is_set()
            if stale:
                abort_all(self.groups)
            self.groups = {}
            self.number = number
            if number <= self._aborted_upto:  # aborted before it was entered
                self.aborted.set()
            else:
                self.aborted.clear()
            settle(stale)

    def abort(self, number: int, on_abort: Callable[[], None]) -> bool:
        """Generation `number` is aborted: if it is the current one, `on_abort()` (the caller's own
        things: its engine, its save) runs and its groups are aborted, a build given up. Returns
        whether it reached the current generation (False: an older one, dropped; a newer one, kept
        for its entry)."""
        with self.lock:
            self._aborted_upto = max(self._aborted_upto, number)
            if number != self.number:
                return False
            self.aborted.set()
            on_abort()
            abort_all(self.groups)
            if self.building is not None:
                self.building.set()
            return True


def abort_all(groups: dict) -> None:
    """Break every group given: waits on them return now, not when a peer gives up or at the timeout."""
    for pg in list(groups.values()):
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - an already broken group may refuse the abort; it is dropped anyway
            pass
