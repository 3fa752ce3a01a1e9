"""A worker's link to its coordinator outside Ray's calls: the job's store (which every part reaches
through `store`, a StoreLink), the coordinator's word that a generation is over (generation_ends.py),
and the watch over the coordinator itself (coordinator_watch.py).

When the coordinator is lost, the worker stops at its next safe point, its shard and replicas in
memory, and waits `elastic.coordinator_wait_s` for a replacement. The replacement takes it over
(worker/actor.py take_over) and the worker follows it: its store, its end keys, its heartbeat
listener. A worker not taken over in time ends itself, and the job, should a coordinator come back,
resumes from its latest checkpoint."""

from __future__ import annotations

import functools
from typing import Callable

from elastic_zero.wire.generation_ends import GenerationEndWatch
from elastic_zero.wire.rendezvous import connect
from elastic_zero.worker.coordinator_watch import WAIT_S, CoordinatorWatch
from elastic_zero.worker.node_duties import coordinator_handle
from elastic_zero.worker.store_link import StoreLink


WATCH_CONNECT_S = 30.0  # to reach the store and answer its challenge


class CoordinatorLink:
    def __init__(self, store_host: str, store_port: int, secret: bytes, timeout_s: float, watched: bool,
                 wait_s: float, abort_generation: Callable[[int], None], on_lost: Callable[[], None],
                 duties) -> None:
        """`watched`: the worker has a coordinator (a test's worker may have none: only the store
        then); `abort_generation(number)`: the coordinator aborted that generation; `on_lost()`: it is
        gone; `duties`: the worker's NodeDuties, whose beats follow a replacement."""
        self._timeout_s, self._abort, self._duties = timeout_s, abort_generation, duties
        self.store = StoreLink(connect(store_host, store_port, secret, timeout_s))
        self._ends = GenerationEndWatch(self.store, abort_generation) if watched else None
        self._watch = CoordinatorWatch(functools.partial(_watch_connection, store_host, store_port, secret), wait_s,
                                       on_lost, functools.partial(_end_this_worker, wait_s)) if watched else None

    def watch_generation(self, number: int) -> None:
        """The worker takes part in generation `number`: its abort, said in the store, reaches it."""
        if self._ends is not None:
            self._ends.watch(number)

    def taking_over(self) -> None:
        """A replacement coordinator is taking this worker over: its wait for one is over."""
        if self._watch is not None:
            self._watch.hold()
        coordinator_handle.cache_clear()  # the lost coordinator's handle, cached, would reach nobody

    def follow(self, store_host: str, store_port: int, secret: bytes, heartbeat_port: int | None) -> None:
        """A coordinator that replaced a lost one took this worker over: its store, its end keys and
        its heartbeat listener from now on, and its actor for the notes (same name, new actor)."""
        self.store.switch(connect(store_host, store_port, secret, self._timeout_s))
        if self._ends is not None:  # the old watch's connection is closed: its thread has ended, or waits idle
            self._ends = GenerationEndWatch(self.store, self._abort)
        if self._watch is not None:
            self._watch.taken_over(functools.partial(_watch_connection, store_host, store_port, secret))
        self._duties.follow(store_host, heartbeat_port, secret)
        coordinator_handle.cache_clear()  # the lost coordinator's handle, cached, would reach nobody


def _watch_connection(host: str, port: int, secret: bytes):
    """A connection of the watch's own to the coordinator's store, without torch (store_client.py)."""
    from elastic_zero.wire.rendezvous import admitted_connection
    from elastic_zero.wire.store_client import StoreClient

    return StoreClient(admitted_connection(host, port, secret, WATCH_CONNECT_S), WAIT_S)


def _end_this_worker(wait_s: float) -> None:
    """No coordinator took this worker over in time: it ends (a detached actor would otherwise hold
    its device for good), by its own handle, as a finished coordinator does."""
    import ray

    print(f"elastic_zero: the coordinator was lost and none took this worker over within {wait_s:g} s: "
          f"the worker ends", flush=True)
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
