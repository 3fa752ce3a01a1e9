"""A worker's start, by phase, told in its hello: how long Ray took to begin it (from the
coordinator's ask to the actor's constructor: a node, a process, Ray's own imports), then its own
imports (torch and the project), its beat process (with the trainer's first settings: its spec read,
its threads), its device (on a GPU, CUDA's context), its model, data and optimizer, the rest of its
setup (store, groups, writer; a joiner's hollow engine, laid out for the handover), and its hello
(its memory facts, the wait for its first beat to be out).

Why: a recovery that finds no worker ready waits for a new one's whole start (on an H200 that wait
was inside `to_enter`, 5.2 and 8.1 s of 6.9 and 12.8 s stalls, before it was split), and which phase
to shorten depends on the machine: the summary's recoveries, `bench gpu` and `bench startup` show it.

Standard library only: actor.py makes the clock before it imports torch.
"""

from __future__ import annotations

import time

PHASES = ("ray", "imports", "beats", "device", "model", "setup", "hello")


class StartClock:
    def __init__(self, asked_at: float | None = None) -> None:
        """`asked_at`: when the coordinator asked Ray for this worker (epoch seconds, its clock)."""
        self.began_at = time.time()
        self.phases: dict[str, float] = {}
        if asked_at is not None:  # another node's clock may run behind the coordinator's: never below 0
            self.phases["ray"] = round(max(0.0, self.began_at - asked_at), 4)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """`phase` ended now: the time since the last lap is its."""
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._last, 4)
        self._last = now

    def told(self) -> dict[str, float]:
        """The phases so far, in the order of a start (what the hello carries)."""
        return {p: self.phases[p] for p in PHASES if p in self.phases}
