"""Whether the workers still starting can ever be placed, asked of the cluster's autoscaler off the
coordinator's loop (its GCS call may take seconds). A verdict counts once it has held for
VERDICT_HOLD_S: the autoscaler reports every few seconds, and a demand it lists for a moment (a
node type at its limit while a lost node is still counted) is not one it can never place."""

from __future__ import annotations

import threading
import time

from elastic_zero.coordinator.autoscaler_view import autoscaler_view
from elastic_zero.plan.worker_demand import unplaceable

LOOK_S = 2.0  # how often, while workers start, the autoscaler is asked
VERDICT_HOLD_S = 10.0  # how long "never" must hold before it is acted on


class PlacementWatch:
    def __init__(self, bundle: dict, labels: dict, read=autoscaler_view) -> None:
        self._bundle, self._labels, self._read = bundle, labels, read
        self._lock = threading.Lock()
        self._reading = False
        self._next_look = 0.0
        self._reason: str | None = None
        self._since: float | None = None  # when the standing verdict was first read
        self._epoch = 0  # reset() starts a new one: a read begun before it says nothing after it

    def look(self, now: float) -> str | None:
        """Called while workers are starting (`now`: time.monotonic()): starts a read in the
        background every LOOK_S; returns why they can never be placed once that has held for
        VERDICT_HOLD_S, else None."""
        with self._lock:
            if now >= self._next_look and not self._reading:
                self._next_look, self._reading = now + LOOK_S, True
                threading.Thread(target=self._read_once, args=(self._epoch,), daemon=True,
                                 name="placement-watch").start()
            if self._reason is not None and now - self._since >= VERDICT_HOLD_S:
                return self._reason
        return None

    def reset(self) -> None:
        """No worker is starting: a verdict held so far no longer stands."""
        with self._lock:
            self._reason = self._since = None
            self._epoch += 1

    def _read_once(self, epoch: int) -> None:
        reason = None
        try:
            reason = unplaceable(self._bundle, self._labels, self._read())
        finally:
            with self._lock:
                if epoch == self._epoch:  # (not begun for workers that were starting before a reset)
                    if reason is None:
                        self._reason = self._since = None
                    elif self._reason is None:
                        self._reason, self._since = reason, time.monotonic()
                self._reading = False
