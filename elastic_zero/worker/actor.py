"""The worker actor: what the coordinator calls, forwarded to the worker's Trainer (trainer.py).

This module imports neither torch nor the engine: the coordinator needs the class to spawn
workers, and it spawns them before it has imported torch itself (a second of a two-core machine,
spent while the workers import it in their own processes). The Trainer is built here, in the
worker's process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from elastic_zero.protocol import OutcomeKind, unpack_plan
from elastic_zero.wire.standing_calls import stand_by
from elastic_zero.worker.start_clock import StartClock

if TYPE_CHECKING:
    from elastic_zero.protocol import Hello, Report


class TrainingWorker:
    def __init__(self, spec: dict, actor_id: str, store_host: str, store_port: int, store_secret: bytes,
                 coordinator: str | None = None, namespace: str | None = None, joiner: bool = False,
                 heartbeat_port: int | None = None, asked_at: float | None = None) -> None:
        start = StartClock(asked_at)  # `asked_at`: when the coordinator asked Ray for this worker
        from elastic_zero.worker.trainer import Trainer

        start.lap("imports")
        self._trainer = Trainer(spec, actor_id, store_host, store_port, store_secret, coordinator, namespace, joiner,
                                heartbeat_port, start)
        # the plan of the generation trained last and its report, kept for a coordinator that replaces
        # a lost one (which never heard the report): given to it by take_over()
        self._training = threading.Lock()
        self._last_plan: bytes | None = None
        self._unheard: Report | None = None

    def hello(self) -> Hello:
        return self._trainer.hello()

    def train(self, packed_plan: bytes, stand: bool = False) -> Report:
        """Train the generation `packed_plan` and return its report. A call that may `stand` goes on
        instead, as long as the worker stays (wire/standing_calls.py): it hands the report in through
        the store and trains the plan the coordinator sets next; it returns (the last report, heard
        already) once a plan leaves it out, or the coordinator is gone, or it left in a handover."""
        with self._training:
            plan = unpack_plan(packed_plan)
            while True:
                self._last_plan, self._unheard = packed_plan, None
                report = self._trainer.train(plan)
                self._unheard = report
                if not stand or report.outcome.kind == OutcomeKind.LEFT:
                    return report
                packed_plan = stand_by(self._trainer.store, plan.number, report)
                if packed_plan is None:
                    return report
                plan = unpack_plan(packed_plan)
                if self._trainer.actor_id not in plan.participants:
                    return report

    def last_plan(self) -> bytes | None:
        """The plan of the generation this worker trained last (or trains now), packed; None: none yet."""
        return self._last_plan

    def take_over(self, store_host: str, store_port: int, store_secret: bytes, heartbeat_port: int | None,
                  wait_s: float) -> Report | None:
        """A coordinator that replaces a lost one takes this worker over: the generation in progress
        stops at its next safe point (or has ended), and its report, which the lost coordinator never
        heard, is the answer (None: it trained none). From then on the worker follows the new
        coordinator's store and listener. A TimeoutError if the generation does not end within `wait_s`.
        The report stays until the next generation: should this coordinator too be lost before it
        starts one, its replacement hears the same report again (the books keep one record a step)."""
        self._trainer.coordinator_lost(taking_over=True)
        if not self._training.acquire(timeout=wait_s):
            raise TimeoutError(f"the generation in progress did not end within {wait_s:g} s")
        try:
            self._trainer.follow(store_host, store_port, store_secret, heartbeat_port)
            return self._unheard
        finally:
            self._training.release()

    def request_safe_point(self, number: int) -> None:
        self._trainer.request_safe_point(number)

    def request_checkpoint(self, number: int) -> None:
        self._trainer.request_checkpoint(number)

    def abort_generation(self, number: int) -> None:
        self._trainer.abort_generation(number)

    def checkpoint_now(self, packed_plan: bytes, final: bool = False) -> dict:
        return self._trainer.checkpoint_now(unpack_plan(packed_plan), final)

    def settle_saves(self) -> dict:
        return self._trainer.settle_saves()

    def memory_report(self) -> dict:
        return self._trainer.memory_report()

    def watch_node(self, node: str) -> None:
        self._trainer.watch_node(node)

    def acknowledge_notice(self, ack: tuple) -> bool | str:
        return self._trainer.acknowledge_notice(ack)
