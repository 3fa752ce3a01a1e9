"""What the outside sees of the coordinator and asks of it: its status (the `status --json`
record), its progress for a driver's progress line, its result and summary, scale and stop requests,
preemption notices; and the notes rank 0 sends it. Mixed into the Coordinator actor; these calls
run on the actor's other threads while its loop drives the job."""

from __future__ import annotations

import functools
import json
import os
import threading
import time

import ray

from elastic_zero.coordinator.events import (CheckpointCommitted, GenerationStepped, PreemptionNotice, ScaleRequested,
                                             StopRequested)
from elastic_zero.observe.live import final_status_key, last_events, status_record
from elastic_zero.observe.worker_timeline import still_here, worker_timeline
from elastic_zero.protocol import Source

NAMESPACE_KV = "elastic_zero"
_NOTES_LOCK = threading.Lock()  # workers' warnings and rank 0's commits arrive on the actor's threads at once


class CoordinatorFace:
    # ---- requests --------------------------------------------------------------------------------

    def scale(self, workers: int) -> str:
        e = self.spec.elastic
        if not e.min_workers <= int(workers) <= e.max_workers:
            raise ValueError(f"scale to {workers}: outside [min_workers, max_workers] = [{e.min_workers}, {e.max_workers}]")
        if self._result is not None:
            raise ValueError(f"job {self.job_id} is over: {self._state_name()}")
        if self.state.stop_requested:
            raise ValueError(f"job {self.job_id} is stopping")
        self._log("scale_requested", workers=int(workers))
        self._inbox.put(ScaleRequested(int(workers)))
        return f"scale to {workers} requested"

    def stop(self, checkpoint: bool = False) -> str:
        """Every stop writes a checkpoint at its safe point (the weights the job ends with); `checkpoint`
        is kept for the callers that ask for it by name."""
        if self._result is not None:
            raise ValueError(f"job {self.job_id} is over: {self._state_name()}")
        self._log("stop_requested", checkpoint=bool(checkpoint))
        self._inbox.put(StopRequested(bool(checkpoint)))
        return "stop requested: the job ends at the next safe point, with a checkpoint there"

    def preemption_notice(self, actor_id: str, deadline_s: float | None = None, source: str = "drill") -> None:
        """Worker `actor_id` goes in `deadline_s` (a SIGTERM it caught, a drill)."""
        self._log("preemption_notice", actor_id=actor_id, deadline_s=deadline_s, source=source)
        self._inbox.put(PreemptionNotice(actor_id))

    def checkpoint_note(self, actor_id: str, directory: str) -> None:
        """Rank 0 committed a checkpoint just now (its writer's thread tells, whatever training does)."""
        self._checkpoint_committed(directory)

    def restored_note(self, generation: int, directory: str, step: int) -> None:
        """Rank 0 restored a checkpoint just now (a recovery's or a resume's): logged by the loop."""
        self._inbox.put(functools.partial(self._checkpoint_restored, generation, directory, step))

    def _checkpoint_restored(self, generation: int, directory: str, step: int | None = None) -> None:
        """A `checkpoint_restored` event, once per generation: rank 0 tells it as it happens (its
        generation's reports name it again at its end); the recovery's step is known from then."""
        if (generation, directory) in self._restores_told:
            return
        self._restores_told.add((generation, directory))
        self._log("checkpoint_restored", generation=generation, directory=directory, step=step)
        if step is not None:
            self.books.restored(generation, step)
        plan = self._plan
        if plan is not None and plan.number == generation and plan.source == Source.CHECKPOINT:
            # now, not only from the generation's reports: should every member be lost, none would name it
            self._add_checkpoint_logs(directory)

    def _saves_skipped(self, generation: int, steps) -> None:
        """Periodic saves the ranks skipped together (every rank's report names the same steps): the
        last one was still being written, and the step never waits for the store."""
        for step in steps:
            self._log("checkpoint_skipped", generation=generation, step=step)
            self.books.checkpoints_skipped.append(step)
        if steps:
            self._warn(f"periodic checkpoints were skipped (the first at step {self.books.checkpoints_skipped[0]}): "
                       f"each came due while the one before was still being written; the store takes longer "
                       f"than checkpoint.every = {self.spec.checkpoint.every} steps")

    def _find_own_commits(self) -> None:
        """This job's commits in its store that no note told of (rank 0 told each as it committed, but
        a note sent just before its process died may never arrive)."""
        c = self.spec.checkpoint
        if self.state.committed or not (c.uri and c.every):
            return
        from elastic_zero.checkpoint import committed_since, open_store

        try:
            fs, root = open_store(c.uri)
            found = committed_since(fs, root, self.started_at)
        except ValueError as exc:  # the store unreadable now: the recovery's own read will say so
            self._log("warning", message=f"could not look for the job's checkpoints: {exc}")
            return
        for directory in found:
            self._checkpoint_committed(directory)

    def _checkpoint_committed(self, directory: str, generation: int | None = None) -> None:
        """A `checkpoint_committed` event, once per directory: rank 0 tells it as it happens, and the
        generation's reports name it again at its end."""
        with _NOTES_LOCK:
            if directory in self._commits_told:
                return
            self._commits_told.add(directory)
        if generation is None and self.state.generation is not None:
            generation = self.state.generation.number
        self._log("checkpoint_committed", generation=generation, directory=directory)
        self.live.checkpoint = directory
        if not self.state.committed:  # before any decision that follows: a loss may now restore it
            self._apply(CheckpointCommitted())

    def worker_warning(self, actor_id: str, message: str) -> None:
        """A Python warning a worker showed (worker/warnings_relay.py): one `warning` event, a line in
        the driver's output, and one summary entry per distinct message, whichever workers said it."""
        self._warn(message, actor_id=actor_id)

    def _warn(self, message: str, **fields) -> None:
        """Something the job could not do as asked, told once (a worker's warning, a failing tracker)."""
        with _NOTES_LOCK:
            if message in self.books.warnings:
                return
            self.books.warnings.append(message)
        self._log("warning", **fields, message=message)

    # ---- notes from rank 0 -----------------------------------------------------------------------

    def generation_stepped(self, number: int) -> None:
        self._inbox.put(GenerationStepped(number, time.time()))

    def progress_note(self, generation: int, step: int, loss: float | None, step_seconds: float, at: float,
                      checkpoint: str | None = None, losses: tuple = ()) -> None:
        """`losses`: (step, loss) of every step since rank 0's last note, for the trackers."""
        self.live.note(step, loss, step_seconds, at)
        if self.tracking is not None:
            self.tracking.train_points(list(losses), self.live.samples_per_s())
        if checkpoint:  # the newest commit rank 0 knows of (the events learn of it at the generation's end)
            self.live.checkpoint = checkpoint
        self.metrics.set("elastic_zero_step", step)
        self.metrics.set("elastic_zero_loss", loss)
        self.metrics.set("elastic_zero_step_seconds", step_seconds)
        self.metrics.set("elastic_zero_samples_per_second", self.live.samples_per_s())
        # Ray exports a gauge only if it was set since the last export: the generation's figures too, each time
        gen = self.state.generation
        if self.live.eval is not None:
            self.metrics.set("elastic_zero_eval_loss", self.live.eval["loss"])
            self.metrics.set("elastic_zero_eval_perplexity", self.live.eval["perplexity"])
        if gen is not None:
            self.metrics.set("elastic_zero_world_size", gen.world_size)
            self.metrics.set("elastic_zero_generation", gen.number)

    def replicas_note(self, generation: int, cadence: dict) -> None:
        """Rank 0 says the replica cadence its generation agreed on (elastic.replicate_every = "auto":
        worker/cadence_meter.py), with its measured cost."""
        self._log("replicas_cadence", generation=generation, **cadence)
        latest = self.live.replicas
        if latest is None or latest["generation"] <= generation:  # (notes are served on several threads)
            self.live.replicas = {"generation": generation, **cadence}

    def _replicas(self, current: bool) -> dict:
        """The replicas' cadence: the one the running generation agreed on (`current`: the status;
        as asked until it agreed), else the latest agreed (the summary)."""
        every = self.spec.elastic.replicate_every
        asked = {"every": None if every == "auto" else every, "auto": every == "auto", "cost": None, "reason": None}
        latest, gen = self.live.replicas, self.state.generation
        if latest is None or (current and (gen is None or latest["generation"] != gen.number)):
            return asked
        return {key: latest[key] for key in asked}

    def eval_note(self, generation: int, result: dict) -> None:
        """Rank 0 evaluated the weights after `result["step"]` steps (worker/evaluation.py)."""
        self._log("eval", generation=generation, **result)
        self.live.eval = {k: result.get(k) for k in ("step", "loss", "perplexity")}
        self.metrics.set("elastic_zero_eval_loss", result["loss"])
        self.metrics.set("elastic_zero_eval_perplexity", result.get("perplexity"))

    def _count_metrics(self, reports, before: tuple[int, int]) -> None:
        """The stalls of the changes the books measured with this generation's results (counted
        `before` them) and the reports' checkpoint figures go into the metrics."""
        for kind, changes in (("recoveries", self.books.recoveries[before[0]:]),
                              ("reconfigurations", self.books.reconfigurations[before[1]:])):
            for change in changes:
                self.metrics.add("elastic_zero_stall_seconds", change.get("stall_s") or 0.0)
                if self.tracking is not None:
                    self.tracking.change(change, kind)
        if self.tracking is not None:
            self.tracking.generation_losses({step: loss for r in reports for step, loss in r.losses})
        for r in reports:
            self.metrics.add("elastic_zero_checkpoint_stall_seconds", sum(r.checkpoint_stall_s))
            self.metrics.add("elastic_zero_checkpoints", len(r.checkpoints))

    # ---- views -----------------------------------------------------------------------------------

    def _state_name(self) -> str:
        r = self._result
        if r is not None:
            if not r["ok"]:
                return "failed"
            return "stopped" if "stopped_at_step" in r["summary"] else "finished"
        st = self.state
        if st.stop_requested:
            return "stopping"
        return {"starting": "starting", "running": "running", "waiting": "waiting"}.get(st.phase.value, st.phase.value)

    def status(self) -> dict:
        with self._lock:
            st = self.state
            gen = st.generation
            members = [{"actor_id": m.actor_id, "rank": gen.members.index(m), "node": m.node} for m in gen.members] \
                if gen else []
        records = list(self.events.records)  # a restarted coordinator's include its predecessors'
        committed = [r["directory"] for r in records if r.get("event") == "checkpoint_committed"]
        starts = [r for r in records if r.get("event") == "generation_start"]
        newest = self.live.checkpoint or (committed[-1] if committed else None)  # live: the later of notes and events
        e = self.spec.elastic
        return status_record(
            job_id=self.job_id, name=self.spec.name, state=self._state_name(),
            generation=gen.number if gen else None, world_size=len(members), target_workers=st.target,
            min_workers=e.min_workers, max_workers=e.max_workers, members=members,
            step=self.live.step, steps=self.spec.train.steps, loss=self.live.loss, eval=self.live.eval,
            samples_per_s=_round(self.live.samples_per_s()), eta_s=_round(self.live.eta_s()),
            # from the events: counted as each change starts, and across coordinator restarts
            # (a generation that restores a checkpoint knows its step once it has read it)
            world_size_history=[[r["step"] if r["step"] >= 0 and not r.get("resume") else None, len(r["workers"])]
                                for r in starts],
            recoveries=sum(r["source"] in ("snapshot", "checkpoint", "restart") for r in starts),
            reconfigurations=sum(r["source"] == "live" for r in starts), restarts=self.restarts,
            checkpoint=newest, run_dir=self.run_dir,
            coordinator={"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                         "node": ray.get_runtime_context().get_node_id()},
            error=(self._result or {}).get("error"), last_events=last_events(records),
            replicas=self._replicas(current=True), workers=still_here(worker_timeline(records)),
            memory={**self.memory.summary(self.state.memory, self._last_plan),
                    "rss_gib": {a: round(p.rss / 2**30, 3) for a, p in sorted(self.heartbeats.progress.items())
                                if a in self._workers and not p.last_word}})

    def progress(self, cursor: int) -> dict:
        """For a driver's progress line: the live figures, the events since `cursor`, and whether
        the job is over (then result() has its outcome)."""
        done = self._done.is_set()  # first: every event of a job that is over is in what follows
        if cursor > len(self.events.records):  # a restarted coordinator that found no log of its predecessor's
            cursor = 0
        events = self.events.since(cursor)
        return {"step": self.live.step, "steps": self.spec.train.steps, "loss": self.live.loss,
                "eval_loss": (self.live.eval or {}).get("loss"),
                "samples_per_s": self.live.samples_per_s(), "eta_s": self.live.eta_s(),
                "world_size": len(self.state.generation.members) if self.state.generation else 0,
                "events": events, "cursor": cursor + len(events), "done": done}

    def _steps_done(self) -> int:
        return max(self.books.step_log) + 1 if self.books.step_log else 0

    def _write_summary(self) -> None:
        if self.tracking is not None:  # a tracker's failure told by now is in the summary's warnings
            self.tracking.flush()
        r = self._result
        summary = {**r["summary"], "ok": r["ok"], "error": r.get("error"), "job_id": self.job_id,
                   "coordinator_restarts": self.restarts, "memory": self.memory.summary(self.state.memory, self._last_plan),
                   "replicas": self._replicas(current=False)}
        r["summary"] = summary
        committed = [e["directory"] for e in self.events.records if e.get("event") == "checkpoint_committed"]
        r["checkpoint"] = committed[-1] if committed else None
        path = os.path.join(self.run_dir, "summary.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(path + ".tmp", path)  # whole or not at all
        if self.tracking is not None:
            self.tracking.finish(path, self._draw_plot(), bool(r["ok"]))

    def _draw_plot(self) -> str | None:
        """RUN_DIR/run.png for the trackers (a plot that cannot be drawn is a warning)."""
        try:
            from elastic_zero.plot import plot_run

            return plot_run(self.run_dir)[0]
        except Exception as exc:  # noqa: BLE001 - an artifact, never the job's outcome
            self._warn(f"tracking: the plot could not be drawn: {type(exc).__name__}: {exc}"[:300])
            return None

    def _final_status(self) -> dict | None:
        """The last status record of this job, if an earlier coordinator of it ended it."""
        try:
            from ray.experimental.internal_kv import _internal_kv_get

            value = _internal_kv_get(final_status_key(self.job_id), namespace=NAMESPACE_KV)
        except Exception:  # noqa: BLE001
            return None
        return json.loads(value) if value else None

    def _publish_final_status(self) -> None:
        """The last status record goes into the cluster's key-value store: `status` answers from it
        once this actor is gone."""
        try:
            from ray.experimental.internal_kv import _internal_kv_put

            _internal_kv_put(final_status_key(self.job_id), json.dumps(self.status()), namespace=NAMESPACE_KV)
        except Exception:  # noqa: BLE001 - status then falls back to what the Ray job says
            pass

    def result(self, timeout_s: float | None = None) -> dict | None:
        """The job's outcome once it is over (None if still running after `timeout_s`): ok, error,
        summary (as written to summary.json) and, on success, the final checkpoint (the weights) by URI."""
        if not self._done.wait(timeout_s):
            return None
        self._collected.set()
        return self._result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
