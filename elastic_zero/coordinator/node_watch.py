"""The coordinator's side of nodes that go, per node: one worker on each node watches its cloud's
metadata server (no extra process); Ray's drains are read here for the whole cluster; a notice for
a node becomes a preemption notice for each of the job's workers there (they hand their shards over
at the next safe point), keeps new workers off that node, and, once the node's workers are gone,
is acknowledged where the cloud wants it (Azure). Workers whose heartbeats (heartbeats.py) stopped
(their node vanished) are counted lost here, and their node is kept out of new placements for a
while; workers whose beats say their training stopped behind their peers' (plan/stuck.py) are
killed here and counted lost, their node kept. Mixed into the Coordinator actor."""

from __future__ import annotations

import threading
import time

import ray

from elastic_zero.coordinator.events import MemorySeen, NodeNotice, PreemptionNotice
from elastic_zero.wire.heartbeats import HeartbeatListener
from elastic_zero.plan.liveness import next_look_at, next_silence_at, nodes_gone_silent, silent_members
from elastic_zero.plan.stuck import Where, stuck_bound_s, stuck_members
from elastic_zero.preemption.notices import Notice
from elastic_zero.preemption.ray_drain import RayDrains
from elastic_zero.protocol import Outcome, OutcomeKind, Report

NODE_ID_LABEL = "ray.io/node-id"
ACK_TIMEOUT_S = 5.0
LOST_NODE_AVOID_S = 120.0  # Ray counts a vanished node alive until its health checks give up
SILENCE_POLL_S = 0.5  # the longest between two looks for silent members (a generation starting, beats resuming)
SILENCE_MIN_GAP_S = 0.002  # the shortest: a member heard just now is not looked at again at once
SILENCE_BEHIND_S = 0.1  # silent ones, but nobody heard: the listener is behind; look again after two of its drains
STUCK_POLL_S = 0.25  # between two looks for stuck members: a bound is seconds long


class NodeWatch:
    def _start_node_watch(self) -> None:
        self._worker_nodes: dict[str, str] = {}  # actor id -> its node
        self._watchers: dict[str, str] = {}  # node -> the worker that watches its metadata server
        self._noticed: dict[str, Notice] = {}  # node -> the first notice for it
        self._lost_nodes: dict[str, float] = {}  # node whose workers went silent -> avoided until (monotonic)
        # actor id -> when its last heartbeat came (monotonic), written by the listener's thread
        self.heartbeats = HeartbeatListener(self.host, self._secret)
        self._heard: dict[str, float] = self.heartbeats.heard
        self._drain_stop = threading.Event()
        if "ray-drain" in self.spec.preemption.watch:
            threading.Thread(target=self._watch_ray_drains, daemon=True, name="ray-drains").start()

    # ---- sources --------------------------------------------------------------------------------

    def node_notice(self, node: str, source: str, deadline_at: float | None, detail: str, ack: tuple = ()) -> None:
        """A watcher says `node` goes by `deadline_at` (epoch seconds; None: unknown, soon)."""
        self._inbox.put(NodeNotice(node, Notice(source, deadline_at, detail, tuple(ack))))

    def liveness(self) -> dict:
        """What the heartbeat listener saw: how many workers it heard, its longest pause."""
        return {"heard": len(self._heard), "listener_longest_pause_s": round(self.heartbeats.longest_pause_s, 3),
                "beats_dropped": self.heartbeats.dropped, "listener_overflows": self.heartbeats.overflows}

    def watcher_note(self, node: str, message: str, problem: bool = True) -> None:
        """What a node's watcher could not read or reach (it says each thing once), or that the node
        has no cloud metadata server (problem False: kept in the log, not shown)."""
        self._log("watcher", node=node, message=message, problem=problem)

    def _watch_ray_drains(self) -> None:
        drains = RayDrains()
        while not self._drain_stop.wait(self.spec.preemption.poll_s):
            ours = set(list(self._worker_nodes.values()))  # a copy: the loop's thread changes it
            for node, notice in drains.draining().items():
                if node in ours and node not in self._noticed:
                    self._inbox.put(NodeNotice(node, notice))
            if drains.problem:
                self._log("watcher", node=None, message=drains.problem, problem=True)
                return

    # ---- the coordinator's side -------------------------------------------------------------------

    def _notice_silent_workers(self) -> float:
        """A participant whose heartbeats stopped is lost (its node vanished; see plan/liveness.py):
        its report will come, if ever, only when Ray's health checks give up on its node, so it is
        counted dead now, with its last sign of life as the time of the failure. Returns when to look
        again (monotonic): the moment the least recently heard would pass the timeout, so that a
        silence is found when it begins and the loop does not scan every member many times a second."""
        timeout_s = self.spec.elastic.heartbeat_timeout_s
        now = time.monotonic()
        if not timeout_s or self._plan is None or not self._train_refs:
            return now + SILENCE_POLL_S
        read_until = self.heartbeats.read_until  # what the listener read: silences are measured up to it
        lost, reason = silent_members(self._heard, self._train_refs.values(), read_until, timeout_s,
                                      witnesses=(a for a in self._workers if a in self._heard))
        if not lost:
            due = next_silence_at(self._heard, self._train_refs.values(), read_until, timeout_s)
            return next_look_at(now, due, SILENCE_POLL_S, SILENCE_MIN_GAP_S, SILENCE_BEHIND_S)
        self._count_dead(lost, reason, {a: self._heard[a] for a in lost}, now)
        self._log("decision", on="Silence", reason=reason, listener_behind_s=round(now - read_until, 3))
        for actor_id in lost:
            self._log("worker_lost", actor_id=actor_id, silent_s=round(read_until - self._heard[actor_id], 2))
        self._nodes_lost(lost, now)
        self._retire(lost, "silent: presumed lost (with its node, unless others are heard there)", lost=True)
        self._generation_failed()
        return now + SILENCE_MIN_GAP_S

    def _notice_stuck_workers(self) -> None:
        """A participant alive but not training while its peers went on past it (plan/stuck.py) is
        killed and counted lost from when it last moved; the generation fails, and the survivors
        recover as from any loss. Its node stays: its other workers may be well."""
        e = self.spec.elastic
        bound_s = stuck_bound_s(self.live.median_step_s(), e.stuck_after_steps, e.stuck_min_s)
        if bound_s is None or self._plan is None or self._failure_seen_at is not None or len(self._train_refs) < 2:
            return
        # stillness too is measured up to what the listener read (a listener behind would make all look still)
        now, beats, moved = self.heartbeats.read_until, self.heartbeats.progress, self.heartbeats.moved
        where = {a: Where(p.generation, p.steps, p.phase, p.collectives) for a in self._train_refs.values()
                 if (p := beats.get(a)) is not None}
        plan = self._plan
        before = {m.actor_id for m in plan.previous.members} if plan.previous is not None else set()
        joiners = {m.actor_id for m in plan.generation.members} - before
        starved = {a: self.heartbeats.starved_s(a) for a in where if now - moved.get(a, now) > bound_s}  # candidates
        stuck, reason = stuck_members(where, moved, self._train_refs.values(), plan.number, plan.step, now, bound_s,
                                      joiners, starved)
        if not stuck:
            return
        self._count_dead(stuck, f"stuck: {reason}", {a: moved[a] for a in stuck}, time.monotonic())
        self._log("decision", on="Stuck", reason=reason)
        for actor_id in stuck:
            still_s = now - moved[actor_id] - starved.get(actor_id, 0.0)
            self._log("worker_stuck", actor_id=actor_id, still_s=round(still_s, 2), where=where[actor_id].describe())
        self._retire(stuck, "stuck: killed (its training stopped behind its peers')", lost=True)
        self._generation_failed()

    def _count_dead(self, actor_ids, error: str, last_sign: dict[str, float], now: float) -> None:
        """Participants given up on before their reports came: dead, from their last sign of life
        (`last_sign`, monotonic; `now` too), their reports no longer awaited."""
        for ref, actor_id in list(self._train_refs.items()):
            if actor_id in actor_ids:
                del self._train_refs[ref]
                ended_at = time.time() - (now - last_sign[actor_id])
                self._results[actor_id] = Report(Outcome(actor_id, OutcomeKind.DEAD, error=error), ended_at=ended_at)

    def _last_words(self, generation: int) -> dict[str, int]:
        """The steps each worker of `generation` whose process ended had done, as its beat process
        said when it ended (a node that vanished says nothing)."""
        return {a: p.steps for a, p in list(self.heartbeats.progress.items())
                if p.last_word and p.generation == generation}

    def _refresh_memory(self) -> None:
        """The memory the workers measured (their hellos, their beats), for the plans to come."""
        view = self.memory.view(self.heartbeats.progress, self._plan)
        if view is not None and view != self.state.memory:
            self._apply(MemorySeen(view))

    def _memory_killed(self, plan) -> None:
        """A worker of `plan` was killed by Ray's memory monitor: no plan of its shape counts on the
        room its node had again (the recovery then drops replicas, or waits for more workers)."""
        self._refresh_memory()
        if self.state.memory is not None:
            self._apply(MemorySeen(self.memory.killed(self.state.memory, plan)))

    def _listen_to(self, participants) -> None:
        """A generation starts: its participants' silence counts from now at the earliest."""
        now = time.monotonic()
        self._heard.update({a: max(self._heard.get(a, now), now) for a in participants})

    def _ours_on(self, node: str) -> list[str]:
        """The job's workers on `node`, as far as their hellos said."""
        return sorted(a for a, n in self._worker_nodes.items() if n == node and a in self._workers)

    def _worker_at(self, actor_id: str, node: str) -> None:
        """A worker said hello from `node`: the node gets a watcher if it has none."""
        self._worker_nodes[actor_id] = node
        if self.spec.preemption.clouds() and node not in self._watchers and not node.startswith("unknown-"):
            self._watchers[node] = actor_id
            self._workers[actor_id].watch_node.remote(node)

    def _on_node_notice(self, item: NodeNotice) -> None:
        node, notice = item.node, item.notice
        if node in self._noticed:
            return  # the first source to tell is acted on; the others say the same
        self._noticed[node] = notice
        here = self._ours_on(node)
        deadline_s = round(notice.deadline_at - time.time(), 1) if notice.deadline_at is not None else None
        self._log("preemption_notice", node=node, source=notice.source, deadline_s=deadline_s, detail=notice.detail,
                  actor_ids=here)
        if here:  # members leave at a safe point; ready ones that have not joined just go: decided together
            self._apply(PreemptionNotice(here[0], tuple(here[1:])))

    def _checkpoint_before_leaving(self) -> None:
        """Workers told to go have nobody to hand their shards to (the state machine's CheckpointNow):
        every member saves the step it reaches next, and training goes on until replacements join
        or the workers go. Without checkpoints, the user is told what will be lost."""
        gen = self.state.generation
        leaving = [a for a in self.state.leaving if any(m.actor_id == a for m in gen.members)]
        if not (self.spec.checkpoint.uri and self.spec.checkpoint.every):
            self._log("warning", message=f"{', '.join(leaving)} must leave and no worker can take their shards, but "
                                         f"the job saves no checkpoints (checkpoint.uri, checkpoint.every): its state "
                                         f"since the start goes with them unless replacements join first")
            return
        self._log("notice_checkpoint", generation=gen.number, actor_ids=leaving)
        self._ask_one_member("request_checkpoint")

    def _nodes_that_go(self) -> set[str]:
        """Told to go, or their workers went silent lately: no new worker should be or stay there."""
        now = time.monotonic()
        return set(self._noticed) | {node for node, until in self._lost_nodes.items() if until > now}

    def _nodes_lost(self, actor_ids, now: float) -> None:
        """Workers lost by their silence: their nodes, where no other worker is heard either, are kept
        out of new placements for a while."""
        node_of = {a: n for a, n in self._worker_nodes.items() if a in self._workers}
        read_until = self.heartbeats.read_until  # heard or not: as far as the listener read
        for node in nodes_gone_silent(actor_ids, node_of, self._heard, read_until,
                                      self.spec.elastic.heartbeat_timeout_s):
            self._lost_nodes[node] = now + LOST_NODE_AVOID_S

    def _spawn_options(self) -> dict:
        """The nodes a new worker may start on: those with the job's labels, and not one that goes. A
        pending worker's selector is its demand as an autoscaler reads it: a node of a type that has
        the labels, and a new one where only nodes that go have room."""
        selector = dict(self.spec.elastic.worker_labels)
        avoid = self._nodes_that_go()
        if avoid:
            selector[NODE_ID_LABEL] = f"!in({','.join(sorted(avoid))})"
        return {"label_selector": selector} if selector else {}

    def _leaving_worker_retired(self, actor_id: str, handle, lost: bool = False) -> None:
        """Before a worker goes: if it watched a node, another of the node's workers takes over, or,
        when it was the last one there, the node's notice is acknowledged through it (not through
        one lost with its node: nobody would answer)."""
        node = self._worker_nodes.pop(actor_id, None)
        if node is None or self._watchers.get(node) != actor_id:
            return
        del self._watchers[node]
        others = self._ours_on(node)
        if others and self._result is None:
            self._watchers[node] = others[0]
            self._workers[others[0]].watch_node.remote(node)
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
