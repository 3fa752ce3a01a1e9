"""The job's workers from spawn to retirement: their handles, the hellos still awaited, and where
they come from (a workforce: workforce.py). It decides nothing: the coordinator says whom to spawn
and whom to retire, and hears each hello from here.

A worker that could not start is told as one line: its own message when it raised one (a
WorkerStartError names the field), else the first line of Ray's; one that no node of the cluster's
autoscaler can host, as a line naming what it asks (placement_watch.py).
"""

from __future__ import annotations

from typing import NamedTuple

import ray

from elastic_zero.coordinator.placement_watch import PlacementWatch
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


class Hello(NamedTuple):
    """A worker's hello as it came: what it said, or why it could not start."""

    actor_id: str
    hello: object = None  # protocol.Hello
    error: str | None = None
    lost: bool = False  # its process or node died while it started (not its start that failed)


class WorkerPool:
    def __init__(self, elastic, completions, workforce) -> None:
        """`elastic`: the job's elastic section; `completions`: where the hellos are watched;
        `workforce`: where the workers come from (workforce.py)."""
        self._elastic, self._completions = elastic, completions
        self._handles: dict[str, object] = {}  # actor id -> handle, from spawn to retirement
        self._hellos: dict = {}  # hello() in flight -> actor id
        self._spawned = 0
        self.placement = PlacementWatch(worker_bundle(elastic.use_gpu, elastic.worker_resources), elastic.worker_labels)
        self.workforce = workforce

    def __contains__(self, actor_id: str) -> bool:
        return actor_id in self._handles

    def __iter__(self):
        return iter(list(self._handles))  # a copy: Ray's threads read while the loop changes it

    def __len__(self) -> int:
        return len(self._handles)

    def handle(self, actor_id: str):
        return self._handles[actor_id]

    def get(self, actor_id: str):
        return self._handles.get(actor_id)

    def spawn(self, count: int, placement: dict, **worker_args) -> list[str]:
        """`count` new workers, placed by `placement` (a label selector), each told `worker_args`:
        their actor ids; their hellos come out of the completions."""
        opts = {"num_gpus": 1} if self._elastic.use_gpu else {"num_cpus": 1}
        if self._elastic.worker_resources:
            opts["resources"] = dict(self._elastic.worker_resources)
        asked = []
        for _ in range(count):
            actor_id = f"w{self._spawned}"
            self._spawned += 1
            handle = self.workforce.spawn({**opts, **placement}, actor_id=actor_id, **worker_args)
            self._handles[actor_id] = handle
            asked.append(actor_id)
            ref = handle.hello.remote()
            self._hellos[ref] = actor_id
            self._completions.watch(ref)
        return asked

    def adopt(self, handles: dict[str, object] | None = None, taken_ids=()) -> set[str]:
        """Workers an earlier coordinator of the job spawned, taken into this pool (actor id -> handle;
        None: those the workforce finds alive): their ids. Those spawned from now on are numbered after
        them and after `taken_ids` (every id the job gave), so no two workers share a name."""
        if handles is None:
            handles = self.workforce.survivors() if hasattr(self.workforce, "survivors") else {}
        self._handles.update(handles)
        numbers = [int(a[1:]) for a in [*handles, *taken_ids] if a[:1] == "w" and a[1:].isdigit()]
        self._spawned = max([self._spawned, *(n + 1 for n in numbers)])
        return set(handles)

    def is_hello(self, ref) -> bool:
        return ref in self._hellos

    def take_hello(self, ref) -> Hello:
        """The hello `ref` brought (is_hello(ref)), or why its worker could not start."""
        actor_id = self._hellos.pop(ref)
        try:
            return Hello(actor_id, ray.get(ref))
        except ray.exceptions.RayError as exc:
            return Hello(actor_id, error=start_error(exc), lost=lost_while_starting(exc))

    def unplaceable(self, now: float) -> str | None:
        """Why the workers still starting can never be placed, once that has held (placement_watch.py)."""
        if not self._hellos:
            self.placement.reset()
            return None
        return self.placement.look(now)

    def give_up_unplaceable(self, now: float, training: bool) -> tuple[str | None, list[str]]:
        """(why, the workers given up on) where the workers still starting can never be placed: no node
        type of the cluster's autoscaler can host them (placement_watch.py), else (None, []). Before the
        job's first generation each is given up on (its hello no longer awaited: the caller ends it), and
        the job ends on a line naming what it asks for (exit 2); a job `training` goes on at its size,
        warned, and keeps them."""
        reason = self.unplaceable(now)
        if reason is None or training:
            return reason, []
        starting = list(self._hellos.values())
        self._hellos.clear()
        return reason, starting

    def remove(self, actor_id: str):
        """`actor_id`'s handle, out of the pool (None: gone already)."""
        return self._handles.pop(actor_id, None)

    def kill(self, handle) -> None:
        self.workforce.kill(handle)
