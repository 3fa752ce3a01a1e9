"""The coordinator's side of nodes that go, and of workers that stop: one worker on each node watches
its cloud's metadata server (no extra process); Ray's drains are read here for the whole cluster;
a notice for a node names the job's workers there (the coordinator has them hand their shards over
at the next safe point), keeps new workers off that node, and, once the node's workers are gone,
is acknowledged where the cloud wants it (Azure). The heartbeats (wire/heartbeats.py) are heard
here (wire/beat_listener.py): a participant whose beats stopped (its node vanished) is found
silent, and its node is kept out of new placements for a while; one whose beats say its training
stopped behind its peers' (plan/stuck.py) is found stuck, its node kept. What is found is returned
(Silence, Stuck); the coordinator counts the lost and recovers."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import NamedTuple

import ray

from elastic_zero.coordinator.events import NodeNotice, ReadyWorkersLost
from elastic_zero.plan.liveness import next_look_at, next_silence_at, nodes_gone_silent, silent_members
from elastic_zero.plan.stuck import Where, judged_members, still_past, stuck_bound_s, stuck_members
from elastic_zero.preemption.notices import Notice
from elastic_zero.preemption.ray_drain import RayDrains
from elastic_zero.wire.beat_listener import HeartbeatListener

NODE_ID_LABEL = "ray.io/node-id"
ACK_TIMEOUT_S = 5.0
LOST_NODE_AVOID_S = 120.0  # Ray counts a vanished node alive until its health checks give up
SILENCE_POLL_S = 0.5  # the longest between two looks for silent members (a generation starting, beats resuming)
SILENCE_MIN_GAP_S = 0.002  # the shortest: a member heard just now is not looked at again at once
SILENCE_BEHIND_S = 0.1  # silent ones, but nobody heard: the listener is behind; look again after two of its drains
STUCK_POLL_S = 0.25  # between two looks for stuck members: a bound is seconds long


class Silence(NamedTuple):
    """Participants whose beats stopped, with when each was last heard (monotonic)."""

    lost: list
    reason: str
    last_heard: dict
    read_until: float  # as far as the listener had read (monotonic)


class Stuck(NamedTuple):
    """Participants whose training stood still behind their peers', with when each last moved."""

    stuck: list
    reason: str
    last_moved: dict
    still_s: dict  # how long each stood still, less its waits for a CPU
    where: dict  # actor id -> where its training stood, in words


class NodeWatch:
    def __init__(self, host: str, secret: bytes, spec, pool, tell, log) -> None:
        """`pool`: the job's workers (worker_pool.py); `tell`: puts a NodeNotice into the coordinator's
        inbox; `log`: writes an event."""
        self._spec, self._pool, self._tell, self._log = spec, pool, tell, log
        self._worker_nodes: dict[str, str] = {}  # actor id -> its node
        self._watchers: dict[str, str] = {}  # node -> the worker that watches its metadata server
        self._noticed: dict[str, Notice] = {}  # node -> the first notice for it
        self._said_listener_ended = False
        self._said_drain_restarts = 0
        self._lost_nodes: dict[str, float] = {}  # node whose workers went silent -> avoided until (monotonic)
        self.heartbeats = HeartbeatListener(host, secret)
        self._heard: dict[str, float] = self.heartbeats.heard  # actor id -> its last beat (monotonic), by the listener
        self._drain_stop = threading.Event()
        if "ray-drain" in spec.preemption.watch:
            threading.Thread(target=self._watch_ray_drains, daemon=True, name="ray-drains").start()

    def close(self) -> None:
        self._drain_stop.set()
        self.heartbeats.close()  # its drain process ends with it (what it heard stays readable)

    def liveness(self) -> dict:
        """What the heartbeat listener saw: how many workers it heard, its drain's longest pause, the
        longest a drain waited to be applied here (the coordinator busy)."""
        return {"heard": len(self._heard), "listener_longest_pause_s": round(self.heartbeats.longest_pause_s, 3),
                "listener_longest_lag_s": round(self.heartbeats.longest_lag_s, 3),
                "beats_dropped": self.heartbeats.dropped, "listener_overflows": self.heartbeats.overflows,
                "drain_restarts": self.heartbeats.drain_restarts,
                "listener_nice": self.heartbeats.drain_nice}

    def _watch_ray_drains(self) -> None:
        drains = RayDrains()
        while not self._drain_stop.wait(self._spec.preemption.poll_s):
            ours = set(list(self._worker_nodes.values()))  # a copy: the loop's thread changes it
            for node, notice in drains.draining().items():
                if node in ours and node not in self._noticed:
                    self._tell(NodeNotice(node, notice))
            if drains.problem:
                self._log("watcher", node=None, message=drains.problem, problem=True)
                return

    # ---- heartbeats ---------------------------------------------------------------------------------

    def listen_to(self, participants) -> None:
        """A generation starts: its participants' silence counts from now at the earliest."""
        now = time.monotonic()
        self._heard.update({a: max(self._heard.get(a, now), now) for a in participants})

    def look_for_silence(self, watched, now: float) -> tuple[Silence | None, float]:
        """The `watched` participants whose heartbeats stopped (their node vanished; see
        plan/liveness.py), and when to look again (monotonic): the moment the least recently heard
        would pass the timeout, so that a silence is found when it begins and the loop does not scan
        every member many times a second. Silences are measured up to what the listener read."""
        timeout_s = self._spec.elastic.heartbeat_timeout_s
        if self.heartbeats.ended and not self._said_listener_ended:
            self._said_listener_ended = True  # then nobody is heard and nobody declared silent: said once
            self._log("warning", message="the heartbeat listener's drain process ended: a vanished node is found "
                                         "only by Ray's death notices and the collective timeout from now on")
        elif self.heartbeats.drain_restarts > self._said_drain_restarts:
            self._said_drain_restarts = self.heartbeats.drain_restarts
            self._log("warning", message=f"the heartbeat listener's drain process ended and was started again "
                                         f"({self._said_drain_restarts} time(s) so far)")
        watched = list(watched)
        if not timeout_s or not watched:
            return None, now + SILENCE_POLL_S
        read_until = self.heartbeats.read_until
        lost, reason = silent_members(self._heard, watched, read_until, timeout_s,
                                      witnesses=(a for a in self._pool if a in self._heard))
        if not lost:
            due = next_silence_at(self._heard, watched, read_until, timeout_s)
            return None, next_look_at(now, due, SILENCE_POLL_S, SILENCE_MIN_GAP_S, SILENCE_BEHIND_S)
        return Silence(sorted(lost), reason, {a: self._heard[a] for a in lost}, read_until), now + SILENCE_MIN_GAP_S

    def lost_while_ready(self, ready, now: float) -> ReadyWorkersLost | None:
        """The `ready` workers (standing by, or waiting to join: no call of ours in flight to say they
        died) whose process ended, as their beat process's last word says, or whose beats stopped (their
        node vanished; that node is then avoided, as a participant's); each logged as lost."""
        ready = [m.actor_id for m in ready]
        ended = [a for a in ready if (p := self.heartbeats.progress.get(a)) is not None and p.last_word]
        why = "its process ended" if ended else None
        timeout_s = self._spec.elastic.heartbeat_timeout_s
        if not ended and timeout_s and ready:
            silent, reason = silent_members(self._heard, ready, self.heartbeats.read_until, timeout_s,
                                            witnesses=(a for a in self._pool if a in self._heard))
            ended, why = list(silent), f"silent: {reason}"
            self.nodes_lost(ended, now)
        for actor_id in ended:
            self._log("worker_lost", actor_id=actor_id, during="ready", error=why)
        return ReadyWorkersLost(tuple(ended), why) if ended else None

    def look_for_stuck(self, run, median_step_s: float | None) -> Stuck | None:
        """The participants of `run` (generation_run.py) alive but not training while their peers went
        on past them (plan/stuck.py)."""
        e = self._spec.elastic
        bound_s = stuck_bound_s(median_step_s, e.stuck_after_steps, e.stuck_min_s)
        if bound_s is None or run.failure_seen_at is not None:
            return None
        training = run.training()  # (a copy, made only when the rule is on: this runs four times a second)
        if len(training) < 2:
            return None
        # stillness too is measured up to what the listener read (a listener behind would make all look still)
        now, beats, moved = self.heartbeats.read_until, self.heartbeats.progress, self.heartbeats.moved
        plan = run.plan
        # only a member still past the bound and in the generation's training loop can be stuck: while
        # none is (every step, and while a generation starts), the rule builds nothing for the others
        candidates = {a: _where(p) for a in still_past(moved, training, now, bound_s) if (p := beats.get(a)) is not None}
        if not judged_members(candidates, candidates, plan.number):
            return None
        where = {a: _where(p) for a in training if (p := beats.get(a)) is not None}
        before = {m.actor_id for m in plan.previous.members} if plan.previous is not None else set()
        joiners = {m.actor_id for m in plan.generation.members} - before
        starved = {a: self.heartbeats.starved_s(a) for a in candidates}
        stuck, reason = stuck_members(where, moved, training, plan.number, plan.step, now, bound_s, joiners, starved)
        if not stuck:
            return None
        return Stuck(sorted(stuck), reason, {a: moved[a] for a in stuck},
                     {a: now - moved[a] - starved.get(a, 0.0) for a in stuck},
                     {a: where[a].describe() for a in stuck})

    def last_words(self, generation: int) -> dict[str, int]:
        """The steps each worker of `generation` whose process ended had done, as its beat process
        said when it ended (a node that vanished says nothing)."""
        return {a: p.steps for a, p in list(self.heartbeats.progress.items())
                if p.last_word and p.generation == generation}

    def beats(self) -> Mapping:
        """actor id -> heartbeats.Progress of its latest beat (a beat_listener.ProgressBook, read-only)."""
        return self.heartbeats.progress

    # ---- nodes -------------------------------------------------------------------------------------

    def nodes_lost(self, actor_ids, now: float) -> None:
        """Workers lost by their silence: their nodes, where no other worker is heard either, are kept
        out of new placements for a while."""
        node_of = {a: n for a, n in self._worker_nodes.items() if a in self._pool}
        read_until = self.heartbeats.read_until  # heard or not: as far as the listener read
        for node in nodes_gone_silent(actor_ids, node_of, self._heard, read_until,
                                      self._spec.elastic.heartbeat_timeout_s):
            self._lost_nodes[node] = now + LOST_NODE_AVOID_S

    def nodes_that_go(self) -> set[str]:
        """Told to go, or their workers went silent lately: no new worker should be or stay there."""
        now = time.monotonic()
        return set(self._noticed) | {node for node, until in self._lost_nodes.items() if until > now}

    def placement(self) -> dict:
        """The nodes a new worker may start on: those with the job's labels, and not one that goes. A
        pending worker's selector is its demand as an autoscaler reads it: a node of a type that has
        the labels, and a new one where only nodes that go have room."""
        selector = dict(self._spec.elastic.worker_labels)
        avoid = self.nodes_that_go()
        if avoid:
            selector[NODE_ID_LABEL] = f"!in({','.join(sorted(avoid))})"
        return {"label_selector": selector} if selector else {}

    def notice(self, item: NodeNotice) -> list[str] | None:
        """A notice that `item.node` goes: the job's workers there (None: the node was noticed before;
        the first source to tell is acted on, the others say the same)."""
        node, notice = item.node, item.notice
        if node in self._noticed:
            return None
        self._noticed[node] = notice
        here = self._ours_on(node)
        deadline_s = round(notice.deadline_at - time.time(), 1) if notice.deadline_at is not None else None
        self._log("preemption_notice", node=node, source=notice.source, deadline_s=deadline_s, detail=notice.detail,
                  actor_ids=here)
        return here

    def _ours_on(self, node: str) -> list[str]:
        """The job's workers on `node`, as far as their hellos said."""
        return sorted(a for a, n in self._worker_nodes.items() if n == node and a in self._pool)

    def worker_at(self, actor_id: str, node: str) -> None:
        """A worker said hello from `node`: the node gets a watcher if it has none."""
        self._worker_nodes[actor_id] = node
        if self._spec.preemption.clouds() and node not in self._watchers and not node.startswith("unknown-"):
            self._watchers[node] = actor_id
            self._pool.handle(actor_id).watch_node.remote(node)

    def worker_gone(self, actor_id: str, handle, lost: bool, job_over: bool) -> None:
        """Before a worker goes (out of the pool already): if it watched a node, another of the node's
        workers takes over, or, when it was the last one there, the node's notice is acknowledged
        through it (not through one lost with its node: nobody would answer)."""
        node = self._worker_nodes.pop(actor_id, None)
        if node is None or self._watchers.get(node) != actor_id:
            return
        del self._watchers[node]
        others = self._ours_on(node)
        if others and not job_over:
            self._watchers[node] = others[0]
            self._pool.handle(others[0]).watch_node.remote(node)
        elif not others and not lost and node in self._noticed and self._noticed[node].ack:
            ack = self._noticed[node].ack
            try:
                done = ray.get(handle.acknowledge_notice.remote(ack), timeout=ACK_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the node may go first; nothing is lost by that
                done = f"{type(exc).__name__}"
            if done is True:
                self._log("notice_acknowledged", node=node, ack=list(ack))
            else:
                self._log("watcher", node=node, message=f"the acknowledgement of {', '.join(ack)} failed: {done}",
                          problem=True)


def _where(progress) -> Where:
    return Where(progress.generation, progress.steps, progress.phase, progress.collectives)
