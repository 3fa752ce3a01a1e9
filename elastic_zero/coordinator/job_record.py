"""What a job leaves behind and shows while it runs: its event log, its books (what each generation
trained, the summary), its live figures, its metrics and trackers. Each commit and each restore is
told once, whichever of rank 0's note or a generation's reports names it first.

The coordinator's loop and its Ray threads (rank 0's notes) both write here: the sets of what was
told are guarded by a lock; the rest is one write each, atomic under the GIL.
"""

from __future__ import annotations

import json
import os
import threading
import time

from elastic_zero.checkpoint.catalog import step_of_directory
from elastic_zero.checkpoint.sample_runs import decode_runs, encode_runs, runs_of_logs
from elastic_zero.coordinator.books import Books
from elastic_zero.coordinator.death_causes import is_memory_kill
from elastic_zero.observe.event_log import EventLog
from elastic_zero.observe.live import LiveProgress, world_size_history
from elastic_zero.observe.metrics import JobMetrics
from elastic_zero.observe.tracking import start_tracking
from elastic_zero.protocol import OutcomeKind, Source


class JobRecord:
    def __init__(self, spec, spec_dict: dict, job_id: str, run_dir: str, started_at: float, restarted: bool) -> None:
        self.spec, self.run_dir = spec, run_dir
        self.books = Books(spec.train.global_batch, spec.train.steps, started_at)
        self.events = EventLog(run_dir, go_on=restarted)
        self.live = LiveProgress(spec.train.global_batch, spec.train.steps)
        self.metrics = JobMetrics(job_id)
        self._lock = threading.Lock()  # workers' warnings and rank 0's commits arrive on the actor's threads at once
        self.tracking = start_tracking(spec, spec_dict, job_id, run_dir, self.warn, restarted)
        if self.tracking is not None:
            self.events.listener = self.tracking.event
        self._commits_told = {r["directory"] for r in self.events.records if r.get("event") == "checkpoint_committed"}
        # an earlier coordinator's: what its generations trained (their reports', and its restores'
        # records of steps whose reports were lost), its workers' starts, its changes
        for r in self.events.records:
            if r.get("event") in ("generation_end", "checkpoint_samples") and r.get("samples"):
                self.books.add_earlier_rows(decode_runs(r["samples"]))
            elif r.get("event") == "worker_ready" and r.get("start_s"):
                self.books.worker_ready(r["actor_id"], r["t"], r["start_s"])
            elif r.get("event") == "change_measured":
                self.books.add_earlier_change(r["what"], r["change"])
        self._sync_world_sizes()  # its generations', the one taken over's too
        # (a coordinator that takes a generation over has its predecessor's told already)
        self._restores_told = {(r["generation"], r["directory"]) for r in self.events.records
                               if r.get("event") == "checkpoint_restored"}
        self._candidate_logs: list = []  # (directory, sample records) of a checkpoint generation's candidates
        self._candidates_for: int | None = None  # that generation
        self._samples_told: set[tuple[int, str]] = set()  # (generation, directory) whose restored records were logged

    def log(self, kind: str, **fields) -> None:
        self.events.add(kind, **fields)

    def warn(self, message: str, **fields) -> None:
        """Something the job could not do as asked, told once (a worker's warning, a failing tracker)."""
        with self._lock:
            if message in self.books.warnings:
                return
            self.books.warnings.append(message)
        self.log("warning", **fields, message=message)

    def worker_ready(self, actor_id: str, hello) -> None:
        """A worker said hello: where it runs, and its start by phase (for the summary's first start
        and for a recovery that waited for it)."""
        told = self.events.add("worker_ready", actor_id=actor_id, node=hello.member.node, pid=hello.pid,
                               node_up_t=None if hello.node_up_at is None else round(hello.node_up_at, 3),
                               start_s=hello.start_s)
        self.books.worker_ready(actor_id, told["t"], hello.start_s)  # the event's time, as a successor reads it

    # ---- checkpoints --------------------------------------------------------------------------------

    def committed(self, directory: str, generation: int | None) -> bool:
        """A `checkpoint_committed` event, once per directory (rank 0 tells it as it happens, and the
        generation's reports name it again at its end): whether this was the first telling."""
        with self._lock:
            if directory in self._commits_told:
                return False
            self._commits_told.add(directory)
        self.log("checkpoint_committed", generation=generation, directory=directory)
        self.live.checkpoint = directory
        return True

    def committed_directories(self) -> list[str]:
        return [e["directory"] for e in self.events.records if e.get("event") == "checkpoint_committed"]

    def commit_of_step(self, step: int) -> str | None:
        """The newest committed checkpoint of `step`, if any."""
        return next((d for d in reversed(self.committed_directories()) if step_of_directory(d) == step), None)

    def restored(self, generation: int, directory: str, step: int | None) -> bool:
        """A `checkpoint_restored` event, once per generation (rank 0 tells it as it happens; its
        generation's reports name it again at its end): whether this was the first telling. The
        recovery's step is known from then."""
        if (generation, directory) in self._restores_told:
            return False
        self._restores_told.add((generation, directory))
        if step is None:  # told by the reports before rank 0's note came: the directory's name says it
            step = step_of_directory(directory)
        self.log("checkpoint_restored", generation=generation, directory=directory, step=step)
        if step is not None:
            self.books.restored(generation, step)
            self._sync_world_sizes()  # a generation with no change pending too (a restarted coordinator's resume)
        return True

    def _sync_world_sizes(self) -> None:
        """The books' [step, size] of each generation from the job's log, as the status reads it (every
        coordinator's generations, one entry each, in the same order as the books append theirs): a
        step the log does not know yet keeps the books' own, -1 where they have none."""
        own = self.books.world_size_history
        self.books.world_size_history = [[(own[i][0] if i < len(own) else -1) if step is None else step, size]
                                         for i, (step, size) in enumerate(world_size_history(self.events.records))]

    def first_step(self) -> int:
        """The job's first step, as its log tells (one that resumed another run's checkpoint began at
        its step; 0 while that is not known)."""
        sizes = world_size_history(self.events.records)
        return (sizes[0][0] or 0) if sizes else 0

    def restore_candidates(self, generation: int, candidates: list[tuple[str, list]]) -> None:
        """The sample records of what `generation` may restore, newest commit first: read when it is
        planned, as pruning may remove them while it trains."""
        self._candidate_logs, self._candidates_for = list(reversed(candidates)), generation

    def add_checkpoint_logs(self, generation: int, restored: str) -> None:
        """The sample records of the restored checkpoint and older commits, for reports that were lost;
        logged once (`checkpoint_samples`), for a coordinator that may replace this one. Only for the
        generation whose candidates were read (a restore of another run's checkpoint books nothing)."""
        if generation != self._candidates_for:
            return
        booked = []
        for directory, rows in self._candidate_logs:  # oldest commit first
            booked += self.books.add_checkpoint_log(rows)
            if directory == restored:
                break
        with self._lock:
            told = (generation, restored) in self._samples_told
            self._samples_told.add((generation, restored))
        if booked and not told:
            self.log("checkpoint_samples", generation=generation, directory=restored, samples=encode_runs(booked))

    def saves_skipped(self, generation: int, steps) -> None:
        """Periodic saves the ranks skipped together (every rank's report names the same steps): the
        last one was still being written, and the step never waits for the store."""
        for step in steps:
            self.log("checkpoint_skipped", generation=generation, step=step)
            self.books.checkpoints_skipped.append(step)
        if steps:
            self.warn(f"periodic checkpoints were skipped (the first at step {self.books.checkpoints_skipped[0]}): "
                      f"each came due while the one before was still being written; the store takes longer "
                      f"than checkpoint.every = {self.spec.checkpoint.every} steps")

    # ---- rank 0's notes -----------------------------------------------------------------------------

    def progress(self, step: int, loss: float | None, step_seconds: float, at: float, checkpoint: str | None,
                 losses: tuple, generation) -> None:
        """Rank 0's progress (`losses`: (step, loss) of every step since its last note, for the
        trackers); `generation`: the one running (None: between two)."""
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
        if self.live.eval is not None:
            self.metrics.set("elastic_zero_eval_loss", self.live.eval["loss"])
            self.metrics.set("elastic_zero_eval_perplexity", self.live.eval["perplexity"])
        if generation is not None:
            self.metrics.set("elastic_zero_world_size", generation.world_size)
            self.metrics.set("elastic_zero_generation", generation.number)

    def replicas_agreed(self, generation: int, cadence: dict) -> None:
        self.log("replicas_cadence", generation=generation, **cadence)
        latest = self.live.replicas
        if latest is None or latest["generation"] <= generation:  # (notes are served on several threads)
            self.live.replicas = {"generation": generation, **cadence}

    def replicas(self, running, current: bool) -> dict:
        """The replicas' cadence: the one the `running` generation agreed on (`current`: the status;
        as asked until it agreed), else the latest agreed (the summary)."""
        every = self.spec.elastic.replicate_every
        asked = {"every": None if every == "auto" else every, "auto": every == "auto", "cost": None, "reason": None}
        latest = self.live.replicas
        if latest is None or (current and (running is None or latest["generation"] != running.number)):
            return asked
        return {key: latest[key] for key in asked}

    def evaluated(self, generation: int, result: dict) -> None:
        """Rank 0 evaluated the weights after `result["step"]` steps (worker/evaluation.py)."""
        self.log("eval", generation=generation, **result)
        self.live.eval = {k: result.get(k) for k in ("step", "loss", "perplexity")}
        self.metrics.set("elastic_zero_eval_loss", result["loss"])
        self.metrics.set("elastic_zero_eval_perplexity", result.get("perplexity"))

    # ---- a generation's start and end, the job's end -----------------------------------------------

    def generation_starts(self, plan, last_end: dict, failed_at: float, reached: int | None, resume: str | None,
                          calls: int | None = None, unheard: tuple | None = None) -> None:
        """`plan` starts after a generation that ended as `last_end` (actor id -> report) says: a
        recovery (from the failure at `failed_at`, epoch seconds, when the lost had `reached` steps;
        `unheard`: (that generation, its lost whose last words are still to come), see
        books.last_words_heard) or a reconfiguration begins in the books; `resume`: what the job
        resumes (a first generation); `calls`: the train calls made for it (its other participants'
        calls stand: they read it from the store)."""
        if plan.source in (Source.SNAPSHOT, Source.CHECKPOINT, Source.RESTART):
            lost = sorted(a + (f" ({r.outcome.error})" if is_memory_kill(r.outcome.error) else "")
                          for a, r in last_end.items() if r.outcome.kind == OutcomeKind.DEAD)
            cause = f"lost {', '.join(lost)}" + ("; restored from a checkpoint" if plan.checkpoints else "") + \
                ("; started over from the initial weights" if plan.source == Source.RESTART else "")
            self.books.begin_change("recovery", failed_at, plan.number, step=plan.step if plan.step >= 0 else None,
                                    cause=cause, reached=reached, source=plan.source, _unheard=unheard)
        elif plan.source == Source.LIVE:
            since = max((r.ended_at for r in last_end.values()), default=time.time())
            self.books.begin_change("reconfiguration", since, plan.number, step=plan.step, **{
                "from": plan.previous.world_size, "to": plan.generation.world_size}, cause=plan.cause)
        self.books.world_size_history.append([plan.step, plan.generation.world_size])
        resumed = {"resume": resume} if plan.source == Source.INIT and resume else {}
        self.log("generation_start", generation=plan.number, step=plan.step, source=plan.source, **resumed,
                 checkpoint=plan.checkpoints[0] if plan.checkpoints else None,
                 workers=[m.actor_id for m in plan.generation.members], leaving=list(plan.leaving),
                 calls=len(plan.participants) if calls is None else calls)
        if plan.source != Source.INIT:
            # for a coordinator that takes this generation over, to measure it (a copy: the books change
            # theirs as they measure it); counted as they start, as status counts them
            self.log("change_begun", generation=plan.number, pending=dict(self.books.pending_change))
            self.metrics.add("elastic_zero_reconfigurations" if plan.source == Source.LIVE else "elastic_zero_recoveries")

    def change_taken_over(self, generation: int) -> None:
        """The change a lost coordinator began with `generation` and did not live to measure (its
        change_begun event): this one measures it, as the generation's reports come to it. The lost
        members' last words it awaited went to its predecessor."""
        records = self.events.records
        begun = [i for i, r in enumerate(records) if r.get("event") == "change_begun"]
        if not begun or records[begun[-1]]["generation"] != generation:
            return
        # measured already, if its predecessor booked the generation's end (the workers then still held
        # its plan, and tell its report again)
        if any(r.get("event") == "generation_end" and r.get("generation") == generation for r in records[begun[-1]:]):
            return
        pending = dict(records[begun[-1]]["pending"])
        self.books.begin_change(pending.pop("_kind"), pending.pop("_since"), generation, **{**pending, "_unheard": None})

    def hear_last_words(self, last_words_of) -> None:
        """The pending recovery's lost members' last words that came after it began, read by
        `last_words_of(generation)` (node_watch.last_words) before its generation is booked."""
        awaited = self.books.words_awaited()
        if awaited is not None:
            self.books.last_words_heard(awaited[0], last_words_of(awaited[0]))

    def generation_ended(self, plan, results: dict) -> tuple:
        """What `plan`'s reports (actor id -> report) say goes into the books, the metrics and the
        log; returns the outcomes of those that lived (leavers' too: after a failed handover they
        still hold shards of the previous layout)."""
        for r in results.values():
            for error in r.checkpoint_errors:
                self.log("checkpoint_failed", generation=plan.number, actor_id=r.outcome.actor_id, error=error)
        # every rank skipped the same saves: any report that lived says which
        self.saves_skipped(plan.number, next((r.checkpoints_skipped for r in results.values() if r.checkpoints_skipped), ()))
        members = {m.actor_id for m in plan.generation.members}
        before = len(self.books.recoveries), len(self.books.reconfigurations)
        booked = [r for a, r in results.items() if a in members]
        self.books.add_generation_results(plan.number, booked)
        for kind, changes in (("recovery", self.books.recoveries[before[0]:]),
                              ("reconfiguration", self.books.reconfigurations[before[1]:])):
            for change in changes:  # for a coordinator that may replace this one (the summary's whole job)
                self.log("change_measured", what=kind, change=dict(change))
        self._count_metrics(results.values(), before)
        outcomes = tuple(r.outcome for r in results.values() if r.outcome.kind != OutcomeKind.DEAD)
        alive = sum(1 for o in outcomes if o.actor_id in members)
        kinds = sorted({o.kind for o in outcomes if o.actor_id in members} | ({OutcomeKind.DEAD} if alive < len(members) else set()))
        self.log("generation_end", generation=plan.number, outcomes=kinds,
                 ended_at={a: round(r.ended_at, 4) for a, r in results.items()},
                 errors={o.actor_id: o.error for o in outcomes if o.error}, **_last_step(results.values()),
                 samples=runs_of_logs(plan.number, [r.log for r in booked] + [r.ward_log for r in booked]))
        return outcomes

    def _count_metrics(self, reports, before: tuple[int, int]) -> None:
        """The stalls of the changes the books measured with a generation's results (counted `before`
        them) and the reports' checkpoint figures go into the metrics."""
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

    def steps_done(self) -> int:
        last = self.books.samples.last_step()
        return 0 if last is None else last + 1

    def write_summary(self, result: dict, **more) -> None:
        """summary.json, whole or not at all: the result's summary and `more`; the result gets the
        written summary and its newest checkpoint. The trackers finish with it."""
        if self.tracking is not None:  # a tracker's failure told by now is in the summary's warnings
            self.tracking.flush()
        summary = {**result["summary"], "ok": result["ok"], "error": result.get("error"), **more}
        result["summary"] = summary
        committed = self.committed_directories()
        result["checkpoint"] = committed[-1] if committed else None
        path = os.path.join(self.run_dir, "summary.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(path + ".tmp", path)
        if self.tracking is not None:
            self.tracking.finish(path, self._draw_plot(), bool(result["ok"]))

    def _draw_plot(self) -> str | None:
        """RUN_DIR/run.png for the trackers (a plot that cannot be drawn is a warning)."""
        try:
            from elastic_zero.plot import plot_run

            return plot_run(self.run_dir)[0]
        except Exception as exc:  # noqa: BLE001 - an artifact, never the job's outcome
            self.warn(f"tracking: the plot could not be drawn: {type(exc).__name__}: {exc}"[:300])
            return None


def _last_step(reports) -> dict:
    """The loss and metrics of a generation's last step, as rank 0 saw them (every rank sees the same)."""
    for r in reports:
        if r.rank == 0 and r.last_loss is not None:
            return {"steps_done": r.outcome.step, "loss": r.last_loss, "metrics": dict(r.last_metrics)}
    return {}
