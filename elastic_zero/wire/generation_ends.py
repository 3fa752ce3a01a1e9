"""How the coordinator tells a generation's participants that it is over: one key in the job's
rendezvous store per generation, set once. "abort" when a participant was lost or its collective
failed (the others give up their groups now rather than at the next collective or the timeout),
"ended" when it ended otherwise (a safe point, the last step), which only releases the waits.

Why not an `abort_generation` call to each survivor: at 1,024 workers that was 1,016 Ray calls
from the coordinator's loop just when it must collect the survivors' reports and plan the
recovery. One store write reaches all of them; each worker waits for its generation's key on a
thread and a store connection of its own (GenerationEndWatch). Several members in one process
(the control-plane bench's simulated hosts) share one watch.
"""

from __future__ import annotations

import datetime
import threading
from typing import Callable

ABORTED, ENDED = b"abort", b"ended"
WAIT = datetime.timedelta(days=7)  # as good as forever: every generation's key is set when it ends


def over_key(number: int) -> str:
    return f"g{number}/over"


def announce_end(store, number: int, aborted: bool) -> None:
    """Generation `number` is over: aborted, or ended. A generation already said to be aborted stays so."""
    if aborted:
        store.set(over_key(number), ABORTED)
    else:
        store.compare_set(over_key(number), "", ENDED)


def was_aborted(store, number: int) -> bool:
    """Whether generation `number` was said to be aborted (False: ended, or not over yet)."""
    key = over_key(number)
    return store.check([key]) and store.get(key) == ABORTED


class GenerationEndWatch:
    """Waits, on a thread of its own, for the end of each generation given to watch() in turn, and
    calls abort(number) when it was aborted. `store` is cloned: its waits block the connection."""

    def __init__(self, store, abort: Callable[[int], None]) -> None:
        self._store, self._abort = store.clone(), abort
        self._releaser = store  # another connection: releases a wait for a generation known to be over
        self._lock = threading.Condition()
        self._watched = -1  # the newest generation given to watch()
        self._waiting_for: int | None = None
        threading.Thread(target=self._run, daemon=True, name="generation-ends").start()

    def watch(self, number: int) -> None:
        """The caller takes part in generation `number`: every generation before it is over (the
        coordinator starts one only after it ended the one before), so a wait for one of those,
        should its key not be set yet, is released."""
        with self._lock:
            if number <= self._watched:
                return
            self._watched = number
            stale = self._waiting_for
            self._lock.notify()
        if stale is not None and stale < number:
            announce_end(self._releaser, stale, aborted=False)

    def _run(self) -> None:
        import torch.distributed as dist

        number = -1
        while True:
            with self._lock:
                while self._watched <= number:
                    self._lock.wait()
                number = self._watched
                self._waiting_for = number
            try:
                self._store.wait([over_key(number)], WAIT)
                said = self._store.get(over_key(number))
            except dist.DistError:  # the store is gone (the coordinator with it): nothing more to watch
                return
            with self._lock:
                self._waiting_for = None
            if said == ABORTED:
                self._abort(number)
