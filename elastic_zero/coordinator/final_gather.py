"""The end of a job: the final weights gathered from the members of the generation that finished,
and a member lost in the gather (its process, or its node: read from its silence as in training)
recovered as a loss in training is. The gather is a collective; its members all hold the last
step's replicas (the last step always commits), so the survivors rebuild the lost shards in a
recovery generation that has no step left to run, and the gather is done again with them.

A mixin of the coordinator actor: it uses the actor's workers, heartbeat books and state machine.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from elastic_zero.coordinator.state import Fail, FinalStateGathered, GenerationEnded
from elastic_zero.plan.liveness import silent_members
from elastic_zero.protocol import Outcome, Report


class FinalGather:
    def _finish(self) -> None:
        plan = self._last_plan
        members = [m.actor_id for m in self.state.generation.members]
        states, lost, errors = self._gather(members, plan)
        if lost:
            self._recover_in_final_gather(members, lost)
            return
        if errors:  # nobody was lost: the worker's own error, which another gather would repeat
            actor_id, error = next(iter(errors.items()))
            self._carry_out(Fail(f"gathering the final weights failed on {actor_id}: {error}"))
            return
        memory = ray.get(self._workers[members[0]].memory_report.remote())
        self._log("job_finished", steps=self.spec.train.steps)
        self._result = {"ok": True, "summary": self.books.summary(memory.get("param_count")),
                        "final_state": states[members[0]]}  # rank 0's: the full weights
        self._apply(FinalStateGathered())

    def _gather(self, members: list[str], plan) -> tuple[dict, dict, dict]:
        """Each member's part of the gather: (states, lost {actor: (when, why)}, errors {actor: why}).
        Once one is lost or fails, the others' group is aborted so that they return at once."""
        refs = {self._workers[a].final_state.remote(True, plan): a for a in members}
        states, lost, errors = {}, {}, {}
        self._listen_to(members)
        broken_at = None
        heartbeat_timeout_s = self.spec.elastic.heartbeat_timeout_s
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
            for ref in done:
                actor_id = refs.pop(ref)
                try:  # rank 0's weights live in its node's object store: that node may go as they are fetched
                    states[actor_id] = ray.get(ref, timeout=self.spec.elastic.collective_timeout_s)
                except ray.exceptions.RayTaskError as exc:  # its collective broke (a peer lost, an abort) or a bug
                    errors[actor_id] = f"{type(exc.cause).__name__}: {exc.cause}"[:300]
                except ray.exceptions.RayError as exc:  # its process or its node died, or took the result along
                    lost[actor_id] = (time.time(), f"lost in the final gather: {type(exc).__name__}: {exc}"[:300])
            if heartbeat_timeout_s and refs:
                now = time.monotonic()
                silent, reason = silent_members(self._heard, refs.values(), now, heartbeat_timeout_s,
                                                witnesses=[a for a in self._workers if a in self._heard])
                for ref, actor_id in list(refs.items()):
                    if actor_id in silent:
                        del refs[ref]
                        lost[actor_id] = (time.time() - (now - self._heard[actor_id]), reason)
                if silent:
                    self._log("decision", on="Silence", reason=reason)
                    self._nodes_lost(silent)
            if (lost or errors) and broken_at is None:
                broken_at = time.monotonic()
                for actor_id in refs.values():
                    self._workers[actor_id].abort_generation.remote(plan.number)
            if broken_at is not None and refs and time.monotonic() - broken_at > self.spec.elastic.collective_timeout_s:
                for ref, actor_id in list(refs.items()):  # alive but not answering: lost as well
                    self._log("worker_unresponsive", actor_id=actor_id)
                    ray.kill(self._workers[actor_id], no_restart=True)
                    lost[actor_id] = (time.time(), "unresponsive in the final gather")
                    del refs[ref]
        return states, lost, errors

    def _recover_in_final_gather(self, members: list[str], lost: dict) -> None:
        """The lost are dead, the others' outcomes stand as their generation ended (finished at the
        last step, holding its replicas): the state machine recovers from them."""
        for actor_id, (_, why) in lost.items():
            self._log("worker_lost", actor_id=actor_id, during="final_gather", error=why)
        self._retire(tuple(lost), "lost in the final gather", lost=True)
        now = time.time()
        self._last_end = {a: Report(Outcome(a, "dead", error=lost[a][1]), ended_at=lost[a][0]) if a in lost
                          else dataclasses.replace(self._last_end[a], ended_at=now) for a in members}
        self._apply(GenerationEnded(tuple(r.outcome for r in self._last_end.values() if r.outcome.kind != "dead")))
