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

What each comes to is returned (Ended, SaveFailed, LostInSave): the coordinator ends the job, fails
it, or recovers.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import ray

from elastic_zero.checkpoint.catalog import directory_uri
from elastic_zero.coordinator.resume import past_the_end
from elastic_zero.wire.generation_ends import announce_end
from elastic_zero.protocol import pack_plan


class Ended(NamedTuple):
    """The job's result: its final weights are written."""

    result: dict


class SaveFailed(NamedTuple):
    message: str


class LostInSave(NamedTuple):
    """Members lost while they wrote the final weights: actor id -> (when, why)."""

    lost: dict


class FinalSave:
    def __init__(self, spec, pool, watch, store, record, committed) -> None:
        """`pool`: the job's workers; `watch`: its node watch (their silence); `store`: the rendezvous
        store (a generation's end key); `record`: the job's record (its commits, its books);
        `committed(directory, generation)`: tells the coordinator of a commit a save reported."""
        self._spec, self._pool, self._watch, self._store, self._record = spec, pool, watch, store, record
        self._committed = committed

    def at_resume(self, step: int, directory: str) -> Ended:
        """The checkpoint to resume from is at or past the last step: the job ends at once, and that
        checkpoint is its final weights. No worker is started."""
        line = past_the_end(step, directory, self._spec.train.steps)
        final_checkpoint = directory_uri(self._spec.checkpoint.uri, directory)
        self._record.log("job_finished", steps=self._spec.train.steps, final_checkpoint=final_checkpoint, note=line)
        summary = {**self._record.books.summary(None, end_step=step), "resumed_from_step": step, "note": line}
        return Ended({"ok": True, "summary": summary, "final_checkpoint": final_checkpoint})

    def finish(self, members: list[str], plan) -> Ended | SaveFailed | LostInSave:
        """The last step is done by `members` (of `plan`): its checkpoint, written again if the loop's
        save of it did not commit."""
        steps = self._spec.train.steps
        written = self._record.commit_of_step(steps)
        if written is None:
            reports, lost, errors = self._save_on(members, plan)
            if lost:
                return LostInSave(lost)
            if errors:  # nobody was lost: the worker's own error, which another save would repeat
                actor_id, error = next(iter(errors.items()))
                return SaveFailed(f"writing the final weights failed on {actor_id}: {error}")
            failures = self._saves_reported(reports.values(), plan.number)
            written = self._record.commit_of_step(steps)
            if written is None:
                why = failures[0] if failures else "no commit was reported"
                return SaveFailed(f"the final weights could not be written to {self._spec.checkpoint.uri}: {why}")
        memory = ray.get(self._pool.handle(members[0]).memory_report.remote())
        final_checkpoint = directory_uri(self._spec.checkpoint.uri, written)
        self._record.log("job_finished", steps=steps, final_checkpoint=final_checkpoint)
        return Ended({"ok": True, "summary": self._record.books.summary(memory.get("param_count"), memory=memory),
                      "final_checkpoint": final_checkpoint})

    def stop(self, step: int, checkpoint: bool, members: list[str], plan) -> Ended | SaveFailed:
        """A stop on request, at the safe point every member reached (`step` steps done; -1: no
        generation runs, nothing to save): a checkpoint there, which holds the weights the job ends
        with (`stop --checkpoint` asks for the same checkpoint)."""
        books = self._record.books
        if step < 0:
            self._record.log("job_stopped", step=None, checkpoint=False)
            return Ended({"ok": True, "summary": {**books.summary(None, end_step=self._record.steps_done()),
                                                  "stopped_at_step": None}})
        handles = [self._pool.handle(a) for a in members]
        # a save of that step in flight may commit; if none did, one now
        failures = self._saves_reported(ray.get([h.settle_saves.remote() for h in handles]), plan.number)
        if self._record.commit_of_step(step) is None:
            shared = pack_plan(plan)
            failures += self._saves_reported(ray.get([h.checkpoint_now.remote(shared) for h in handles]), plan.number)
        for error in failures:
            self._record.log("checkpoint_failed", generation=plan.number, error=error)
        written = self._record.commit_of_step(step)
        if written is None:
            why = failures[-1] if failures else "no commit was reported"
            return SaveFailed(f"stopped at step {step}, but its checkpoint (the final weights) could not be written "
                              f"to {self._spec.checkpoint.uri}: {why}")
        memory = ray.get(handles[0].memory_report.remote())
        final_checkpoint = directory_uri(self._spec.checkpoint.uri, written)
        self._record.log("job_stopped", step=step, checkpoint=checkpoint, final_checkpoint=final_checkpoint)
        summary = {**books.summary(memory.get("param_count"), step, memory), "stopped_at_step": step}
        return Ended({"ok": True, "summary": summary, "final_checkpoint": final_checkpoint})

    def _saves_reported(self, reports, generation: int) -> list[str]:
        """Record the commits the members' save reports name (rank 0's); return their errors."""
        errors = []
        for r in reports:
            for directory in r["checkpoints"]:
                self._committed(directory, generation)
            errors += r["checkpoint_errors"]
        return errors

    def _save_on(self, members: list[str], plan) -> tuple[dict, dict, dict]:
        """Each member's part of the final save: (reports, lost {actor: (when, why)}, errors {actor: why}).
        Once one is lost or fails, the others' groups are aborted so that they return at once."""
        shared = pack_plan(plan)  # serialized once, not once per member
        refs = {self._pool.handle(a).checkpoint_now.remote(shared, True): a for a in members}
        reports, lost, errors = {}, {}, {}
        self._watch.listen_to(members)
        broken_at = None
        timeout_s = self._spec.elastic.collective_timeout_s
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
            for ref in done:
                actor_id = refs.pop(ref)
                try:
                    reports[actor_id] = ray.get(ref, timeout=timeout_s)
                except ray.exceptions.RayTaskError as exc:  # a bug, or its save broke
                    errors[actor_id] = f"{type(exc.cause).__name__}: {exc.cause}"[:300]
                except ray.exceptions.RayError as exc:  # its process or its node died
                    lost[actor_id] = (time.time(), f"lost in the final save: {type(exc).__name__}: {exc}"[:300])
            now = time.monotonic()
            silence, _ = self._watch.look_for_silence(refs.values(), now)
            if silence is not None:
                for ref, actor_id in list(refs.items()):
                    if actor_id in silence.last_heard:
                        del refs[ref]
                        lost[actor_id] = (time.time() - (now - silence.last_heard[actor_id]), silence.reason)
                self._record.log("decision", on="Silence", reason=silence.reason)
                self._watch.nodes_lost(silence.lost, now)
            if (lost or errors) and broken_at is None:
                broken_at = time.monotonic()
                # its end key says so too (it said "ended" when training ended): a member that enters
                # the next generation before the call below reaches it leaves this one's groups aborted
                announce_end(self._store, plan.number, aborted=True)
                for actor_id in refs.values():
                    self._pool.handle(actor_id).abort_generation.remote(plan.number)
            if broken_at is not None and refs and time.monotonic() - broken_at > timeout_s:
                for ref, actor_id in list(refs.items()):  # alive but not answering: lost as well
                    self._record.log("worker_unresponsive", actor_id=actor_id)
                    self._pool.kill(self._pool.handle(actor_id))
                    lost[actor_id] = (time.time(), "unresponsive in the final save")
                    del refs[ref]
        return reports, lost, errors
