"""The coordinator's side of workers coming and going: spawning them where they may run, hearing
their hello, retiring them. A mixin of Coordinator (actor.py), which owns the handles.

Workers are spawned off the nodes that go (node_watch.py). A worker that could not start is told as
one line: its own message when it raised one (a WorkerStartError names the field), else the first
line of Ray's; one that no node of the cluster's autoscaler can host, as a line naming what it asks.
"""

from __future__ import annotations

import time

import ray

from elastic_zero.coordinator.events import WorkersReady, WorkerStartFailed
from elastic_zero.coordinator.placement_watch import PlacementWatch
from elastic_zero.coordinator.workforce import RayWorkforce
from elastic_zero.plan.worker_demand import worker_bundle


def start_error(exc: Exception) -> str:
    """One line for a worker that could not start: its own message when it raised one (a
    WorkerStartError names the field), else the first line of Ray's (the process died)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and str(cause):
        return str(cause).splitlines()[0][:300]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def lost_while_starting(exc: Exception) -> bool:
    """The starting actor's process or node died (Ray's doing), rather than its start failing:
    hello() raising is a RayTaskError (our one-line start error), a constructor that raised is an
    ActorDiedError whose creation task failed."""
    if not isinstance(exc, ray.exceptions.RayActorError):
        return False
    return not getattr(exc, "actor_init_failed", False)


class WorkerSpawner:
    def _start_spawner(self, workforce=None) -> None:
        self._workers: dict[str, object] = {}  # actor id -> handle, from spawn to retirement
        self._ready_refs: dict = {}  # hello() in flight -> actor id
        self._spawned = 0
        elastic = self.spec.elastic
        self.placement = PlacementWatch(worker_bundle(elastic.use_gpu, elastic.worker_resources), elastic.worker_labels)
        self.workforce = workforce or RayWorkforce()

    def _spawn(self, count: int) -> None:
        elastic = self.spec.elastic
        opts = {"num_gpus": 1} if elastic.use_gpu else {"num_cpus": 1}
        if elastic.worker_resources:
            opts["resources"] = dict(elastic.worker_resources)
        joiner = self.state.generation is not None  # it will receive its shard by handover
        asked, asked_t = [], time.time()  # before the requests: an autoscaler may answer before the event is written
        for _ in range(count):
            actor_id = f"w{self._spawned}"
            self._spawned += 1
            handle = self.workforce.spawn(
                {**opts, **self._spawn_options()}, spec=self.spec_dict, actor_id=actor_id, store_host=self.host,
                store_port=self.rendezvous.port, store_secret=self._secret, coordinator=self._coordinator_name,
                namespace=self._namespace, joiner=joiner, heartbeat_port=self.heartbeats.port)
            self._workers[actor_id] = handle
            asked.append(actor_id)
            ref = handle.hello.remote()
            self._ready_refs[ref] = actor_id
            self.completions.watch(ref)
        self._log("spawn", count=count, actor_ids=asked, asked_t=round(asked_t, 4))

    def _hello_arrived(self, ref) -> None:
        actor_id = self._ready_refs.pop(ref)
        try:
            hello = ray.get(ref)
        except ray.exceptions.RayError as exc:
            error = start_error(exc)
            self._log("worker_start_failed", actor_id=actor_id, error=error)
            self._apply(WorkerStartFailed(actor_id, error, lost=lost_while_starting(exc)))
            return
        self._log("worker_ready", actor_id=actor_id, node=hello.member.node, pid=hello.pid,
                  node_up_t=None if hello.node_up_at is None else round(hello.node_up_at, 3))
        if hello.member.node in self._nodes_that_go():  # placed there before Ray or we knew: another is asked for
            self._retire((actor_id,), "it started on a node that goes")
            self._apply(WorkerStartFailed(actor_id, "it started on a node that goes", lost=True))
            return
        self._worker_at(actor_id, hello.member.node)
        self.memory.hello(actor_id, hello.member.node, hello.memory)
        self._refresh_memory()  # its node counts in the plan its readiness may start
        if hello.warning:
            self._log("warning", actor_id=actor_id, message=hello.warning)
            self.books.warnings.append(hello.warning)
        self._apply(WorkersReady((hello.member,)))

    def _notice_unplaceable_workers(self) -> None:
        """Workers still starting that no node type of the cluster's autoscaler can host would wait
        for ever (placement_watch.py). Before the job's first generation each fails to start, with a
        line naming what the job asks for, and the state machine ends the job (exit 2); a job that
        trains goes on at its size, warned once."""
        if not self._ready_refs:
            self.placement.reset()
            return
        reason = self.placement.look(time.monotonic())
        if reason is None:
            return
        if self.state.generation is not None:
            self._warn(f"a replacement worker can never be placed: {reason}")
            return
        for ref, actor_id in list(self._ready_refs.items()):
            del self._ready_refs[ref]  # its hello, when the kill ends it, is not waited for
            self._log("worker_start_failed", actor_id=actor_id, error=reason)
            self._retire((actor_id,), "no node can host it")
            self._apply(WorkerStartFailed(actor_id, reason, bad_input=True))

    def _retire(self, actor_ids, why: str, lost: bool = False) -> None:
        for actor_id in actor_ids:
            handle = self._workers.pop(actor_id, None)
            self.memory.forget(actor_id)
            if handle is not None:
                self._leaving_worker_retired(actor_id, handle, lost)
                self.workforce.kill(handle)
        if actor_ids:
            self._log("retire", actor_ids=list(actor_ids), why=why)
