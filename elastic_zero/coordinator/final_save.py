"""The end of a job: the final weights are the checkpoint of its last step, written by the workers
(each its own part, rank 0 commits), never gathered: neither the coordinator nor the driver holds
a tensor. A job with no checkpoint.uri writes it to its run directory (job/prepare.py).

The last step's save normally commits inside the step loop. When it did not (a member was lost
while it was written, or while the last step ran), the job recovers as from any loss: the last
step always commits its replicas, so the survivors rebuild the lost shards in a generation with no
step left to run, and then write the final checkpoint again (a job without replicas,
replicate_every = 0, restores its latest checkpoint and trains the steps after it again). A member lost in that save (its
process, or its node: read from its silence as in training) is recovered the same way.

A stop on request ends the same way, at the step it stopped at; and a job that resumes from a
checkpoint at or past its last step ends at once, with that checkpoint as its final weights.

A mixin of the coordinator actor: it uses the actor's workers, heartbeat books and state machine.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from elastic_zero.checkpoint.catalog import directory_uri, step_of_directory
from elastic_zero.coordinator.resume import past_the_end
from elastic_zero.coordinator.state import Fail, FinalWeightsWritten, GenerationEnded, Stop
from elastic_zero.wire.generation_ends import announce_end
from elastic_zero.plan.liveness import silent_members
from elastic_zero.protocol import Outcome, OutcomeKind, Report, pack_plan

class FinalSave:
    def _finish_at_resume(self, step: int, directory: str) -> None:
        """The checkpoint to resume from is at or past the last step: the job ends at once, and that
        checkpoint is its final weights. No worker is started."""
        line = past_the_end(step, directory, self.spec.train.steps)
        self._log("job_finished", steps=self.spec.train.steps, final_checkpoint=directory_uri(self.spec.checkpoint.uri,
                                                                                               directory), note=line)
        summary = {**self.books.summary(None, end_step=step), "resumed_from_step": step, "note": line}
        self._result = {"ok": True, "summary": summary,
                        "final_checkpoint": directory_uri(self.spec.checkpoint.uri, directory)}

    def _commit_of_step(self, step: int) -> str | None:
        """The newest committed checkpoint of `step`, if any."""
        committed = [e["directory"] for e in self.events.records if e.get("event") == "checkpoint_committed"]
        return next((d for d in reversed(committed) if step_of_directory(d) == step), None)

    def _finish(self) -> None:
        plan = self._last_plan
        members = [m.actor_id for m in self.state.generation.members]
        written = self._commit_of_step(self.spec.train.steps)
        if written is None:  # the loop's save of the last step did not commit: written again now
            reports, lost, errors = self._save_on(members, plan)
            if lost:
                self._recover_in_final_save(members, lost)
                return
            if errors:  # nobody was lost: the worker's own error, which another save would repeat
                actor_id, error = next(iter(errors.items()))
                self._carry_out(Fail(f"writing the final weights failed on {actor_id}: {error}"))
                return
            failures = self._saves_reported(reports.values(), plan.number)
            written = self._commit_of_step(self.spec.train.steps)
            if written is None:
                why = failures[0] if failures else "no commit was reported"
                self._carry_out(Fail(f"the final weights could not be written to {self.spec.checkpoint.uri}: {why}"))
                return
        memory = ray.get(self._workers[members[0]].memory_report.remote())
        final_checkpoint = directory_uri(self.spec.checkpoint.uri, written)
        self._log("job_finished", steps=self.spec.train.steps, final_checkpoint=final_checkpoint)
        self._result = {"ok": True, "summary": self.books.summary(memory.get("param_count"), memory=memory),
                        "final_checkpoint": final_checkpoint}
        self._apply(FinalWeightsWritten())

    def _saves_reported(self, reports, generation: int) -> list[str]:
        """Record the commits the members' save reports name (rank 0's); return their errors."""
        errors = []
        for r in reports:
            for directory in r["checkpoints"]:
                self._checkpoint_committed(directory, generation)
            errors += r["checkpoint_errors"]
        return errors

    def _save_on(self, members: list[str], plan) -> tuple[dict, dict, dict]:
        """Each member's part of the final save: (reports, lost {actor: (when, why)}, errors {actor: why}).
        Once one is lost or fails, the others' groups are aborted so that they return at once."""
        shared = pack_plan(plan)  # serialized once, not once per member
        refs = {self._workers[a].checkpoint_now.remote(shared, True): a for a in members}
        reports, lost, errors = {}, {}, {}
        self._listen_to(members)
        broken_at = None
        heartbeat_timeout_s = self.spec.elastic.heartbeat_timeout_s
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
            for ref in done:
                actor_id = refs.pop(ref)
                try:
                    reports[actor_id] = ray.get(ref, timeout=self.spec.elastic.collective_timeout_s)
                except ray.exceptions.RayTaskError as exc:  # a bug, or its save broke
                    errors[actor_id] = f"{type(exc.cause).__name__}: {exc.cause}"[:300]
                except ray.exceptions.RayError as exc:  # its process or its node died
                    lost[actor_id] = (time.time(), f"lost in the final save: {type(exc).__name__}: {exc}"[:300])
            if heartbeat_timeout_s and refs:
                now = time.monotonic()  # silences measured up to what the listener read (heartbeats.py)
                silent, reason = silent_members(self._heard, refs.values(), self.heartbeats.read_until,
                                                heartbeat_timeout_s,
                                                witnesses=(a for a in self._workers if a in self._heard))
                for ref, actor_id in list(refs.items()):
                    if actor_id in silent:
                        del refs[ref]
                        lost[actor_id] = (time.time() - (now - self._heard[actor_id]), reason)
                if silent:
                    self._log("decision", on="Silence", reason=reason)
                    self._nodes_lost(silent, now)
            if (lost or errors) and broken_at is None:
                broken_at = time.monotonic()
                # its end key says so too (it said "ended" when training ended): a member that enters
                # the next generation before the call below reaches it leaves this one's groups aborted
                announce_end(self.rendezvous.store, plan.number, aborted=True)
                for actor_id in refs.values():
                    self._workers[actor_id].abort_generation.remote(plan.number)
            if broken_at is not None and refs and time.monotonic() - broken_at > self.spec.elastic.collective_timeout_s:
                for ref, actor_id in list(refs.items()):  # alive but not answering: lost as well
                    self._log("worker_unresponsive", actor_id=actor_id)
                    self.workforce.kill(self._workers[actor_id])
                    lost[actor_id] = (time.time(), "unresponsive in the final save")
                    del refs[ref]
        return reports, lost, errors

    def _recover_in_final_save(self, members: list[str], lost: dict) -> None:
        """The lost are dead, the others' outcomes stand as their generation ended (finished at the
        last step, holding its replicas): the state machine recovers from them."""
        for actor_id, (_, why) in lost.items():
            self._log("worker_lost", actor_id=actor_id, during="final_save", error=why)
        self._retire(tuple(lost), "lost in the final save", lost=True)
        now = time.time()
        self._last_end = {a: Report(Outcome(a, OutcomeKind.DEAD, error=lost[a][1]), ended_at=lost[a][0]) if a in lost
                          else dataclasses.replace(self._last_end[a], ended_at=now) for a in members}
        self._apply(GenerationEnded(tuple(r.outcome for r in self._last_end.values() if r.outcome.kind != OutcomeKind.DEAD)))

    def _stop(self, command: Stop) -> None:
        """A stop on request, at the safe point every member reached: a checkpoint there, which
        holds the weights the job ends with (`stop --checkpoint` asks for the same checkpoint)."""
        if command.step < 0:  # asked before training started, or while waiting for workers: nothing to save
            self._log("job_stopped", step=None, checkpoint=False)
            self._result = {"ok": True, "summary": {**self.books.summary(None, end_step=self._steps_done()),
                                                    "stopped_at_step": None}}
            return
        members = [m.actor_id for m in self.state.generation.members]
        plan = self._last_plan
        # a save of that step in flight may commit; if none did, one now
        failures = self._saves_reported(ray.get([self._workers[a].settle_saves.remote() for a in members]), plan.number)
        if self._commit_of_step(command.step) is None:
            shared = pack_plan(plan)
            failures += self._saves_reported(ray.get([self._workers[a].checkpoint_now.remote(shared) for a in members]),
                                             plan.number)
        for error in failures:
            self._log("checkpoint_failed", generation=plan.number, error=error)
        written = self._commit_of_step(command.step)
        if written is None:
            why = failures[-1] if failures else "no commit was reported"
            self._carry_out(Fail(f"stopped at step {command.step}, but its checkpoint (the final weights) could not "
                                 f"be written to {self.spec.checkpoint.uri}: {why}"))
            return
        memory = ray.get(self._workers[members[0]].memory_report.remote())
        final_checkpoint = directory_uri(self.spec.checkpoint.uri, written)
        self._log("job_stopped", step=command.step, checkpoint=command.checkpoint, final_checkpoint=final_checkpoint)
        summary = {**self.books.summary(memory.get("param_count"), command.step, memory), "stopped_at_step": command.step}
        self._result = {"ok": True, "summary": summary, "final_checkpoint": final_checkpoint}
