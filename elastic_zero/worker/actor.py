"""The worker actor: what the coordinator calls, forwarded to the worker's Trainer (trainer.py).

This module imports neither torch nor the engine: the coordinator needs the class to spawn
workers, and it spawns them before it has imported torch itself (a second of a two-core machine,
spent while the workers import it in their own processes). The Trainer is built here, in the
worker's process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_zero.protocol import unpack_plan

if TYPE_CHECKING:
    from elastic_zero.protocol import Hello, Report


class TrainingWorker:
    def __init__(self, spec: dict, actor_id: str, store_host: str, store_port: int, store_secret: bytes,
                 coordinator: str | None = None, namespace: str | None = None, joiner: bool = False,
                 heartbeat_port: int | None = None) -> None:
        from elastic_zero.worker.trainer import Trainer

        self._trainer = Trainer(spec, actor_id, store_host, store_port, store_secret, coordinator, namespace, joiner,
                                heartbeat_port)

    def hello(self) -> Hello:
        return self._trainer.hello()

    def train(self, packed_plan: bytes) -> Report:
        return self._trainer.train(unpack_plan(packed_plan))

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
