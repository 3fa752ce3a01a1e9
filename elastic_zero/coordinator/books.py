"""The coordinator's books: what each generation trained, and the summary they add up to.

Workers report, per step, the global sample positions each rank trained on. A step recomputed
after a failure is reported again by a later generation, whose report replaces the earlier one;
the summary counts duplicates and gaps over what was kept (sample_ledger.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from elastic_zero.coordinator.sample_ledger import SampleLedger
from elastic_zero.protocol import OutcomeKind, Report


@dataclass
class Books:
    global_batch: int
    steps: int
    started_at: float
    samples: SampleLedger = field(init=False)  # which positions each step trained, by the generation that stands
    world_size_history: list = field(default_factory=list)  # [step, size]
    recoveries: list = field(default_factory=list)
    reconfigurations: list = field(default_factory=list)
    first_step_at: float | None = None
    last_loss: float | None = None
    last_metrics: dict = field(default_factory=dict)
    loss_curve: dict = field(default_factory=dict)  # step -> loss; a step recomputed later is replaced
    evals: dict = field(default_factory=dict)  # step -> the evaluation of its weights; one redone later replaces it
    step_seconds: dict = field(default_factory=dict)  # step -> (its time, of it protecting it) on rank 0, the same way
    step_ends: dict = field(default_factory=dict)  # step -> the epoch time it was done, on rank 0, the same way
    start: dict = field(default_factory=dict)  # how the first generation entered: its phases, the bytes it read
    pending_change: dict | None = None  # a change whose stall is measured when the next generation reports
    pending_generation: int | None = None  # the generation that began with the pending change
    pending_stepped_at: float | None = None  # when rank 0 said that generation's first step was done
    checkpoint_stalls: list = field(default_factory=list)
    checkpoint_errors: list = field(default_factory=list)
    checkpoints_skipped: list = field(default_factory=list)  # steps whose periodic save came due while the last wrote
    warnings: list = field(default_factory=list)  # what the job could not do as asked, e.g. place buddies by node
    # actor id -> (when it said hello, epoch; its start by phase: worker/start_clock.py)
    worker_starts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples = SampleLedger(self.global_batch)

    def add_generation_results(self, generation: int, results: list[Report]) -> None:
        firsts = [r.first_step_at for r in results if r.first_step_at]
        if firsts and self.first_step_at is None:
            self.first_step_at = min(firsts)
            self.start = {"phases_s": _slowest_phases(results), "received_bytes": max(r.received_bytes for r in results),
                          "worker_start_s": self._new_worker(results)[0]}
        if not firsts and self.pending_change is not None and results and \
                all(r.outcome.kind == OutcomeKind.FINISHED for r in results):
            self._close_change_without_a_step(results)
        elif not firsts and self.pending_change is not None and self.pending_stepped_at is not None:
            self._close_change_of_a_lost_generation(results)
        if firsts and self.pending_change is not None:
            change = self.pending_change
            since = change.pop("_since")
            if "reached" in change:  # a recovery: where it restarted, and what that cost
                reached = change.pop("reached")
                if change.get("step") is None:  # from a checkpoint: the first step the workers ran
                    change["step"] = min(step for r in results for step, *_ in r.log) \
                        if any(r.log for r in results) else None
                    # (the generation's entry: the last; a replacement coordinator's begin with its predecessor's)
                    if change["step"] is not None and self.world_size_history and self.world_size_history[-1][0] < 0:
                        self.world_size_history[-1][0] = change["step"]  # known now that it was read
                _count_lost_steps(change, reached)
            change["failed_at"] = round(since, 4)  # the failure (or the safe point), epoch seconds
            change["stall_s"] = round(min(firsts) - since, 4)  # to the next step starting
            done = [r.step_ends[0] for r in results if r.step_ends]  # an evaluation before it included
            change["to_next_step_done_s"] = round(max(done) - since, 4) if done else None
            change["first_step_s"] = round(max(r.step_times[0] for r in results if r.step_times), 4) if done else None
            change["phases_s"] = _slowest_phases(results)
            change["received_bytes"] = max(r.received_bytes for r in results)  # the busiest receiver's
            self._add_new_worker(change, results, since)
            entered = [r.entered_at for r in results if r.entered_at]
            if entered:  # from the failure (or the safe point) until the last participant began the next generation
                change["phases_s"]["to_enter"] = round(max(entered) - since, 4)
            self._file_pending()
        # a rank's committed steps, reported by itself and (if it was lost) by its buddy
        self.samples.add(generation, [log for r in results for log in (r.log, r.ward_log)])
        for r in results:
            self.checkpoint_stalls.extend(r.checkpoint_stall_s)
            self.checkpoint_errors.extend(r.checkpoint_errors)
            if r.last_loss is not None and r.rank == 0:
                self.last_loss, self.last_metrics = r.last_loss, dict(r.last_metrics)
            self.loss_curve.update(dict(r.losses))
            self.evals.update((e["step"], dict(e)) for e in r.evals)
        # a rank's losses and step times both begin at the generation's first step and follow its steps
        # (a loss is read a step late: a failed generation's may be one short, and zip drops that step's
        # time); this generation's times replace an earlier one's for the steps it ran again. One rank's clock:
        # its steps follow each other, so their times add up to its wall time (a maximum over ranks
        # would count the ranks' skew against each other as time spent); rank 0's, else another's.
        seconds, ends = {}, {}
        for r in sorted(results, key=lambda r: r.rank != 0):
            if not r.losses or seconds.keys() >= set(next(zip(*r.losses))):  # (in C: 1,024 ranks' same steps)
                continue
            for (step, _), t, protect, end in zip(r.losses, r.step_times, r.protect_times, r.step_ends):
                seconds.setdefault(step, (t, protect))
                ends.setdefault(step, end)
        self.step_seconds.update(seconds)
        self.step_ends.update(ends)

    def worker_ready(self, actor_id: str, at: float, start_s: dict) -> None:
        """`actor_id` said hello at `at` (epoch), its start by phase `start_s` (empty: not told)."""
        if start_s:
            self.worker_starts[actor_id] = (at, dict(start_s))

    def _new_worker(self, results: list[Report], after: float | None = None) -> tuple[dict | None, float | None]:
        """Of the participants that said hello after `after` (epoch; None: all), the one that said it
        last: its start by phase, and how long after `after` its hello came. (None, None) where there
        is none, or none told its start."""
        starts = [self.worker_starts.get(r.outcome.actor_id) for r in results]
        starts = [s for s in starts if s is not None and (after is None or s[0] > after)]
        if not starts:
            return None, None
        at, phases = max(starts, key=lambda s: s[0])
        return phases, None if after is None else round(at - after, 4)

    def _add_new_worker(self, change: dict, results: list[Report], since: float) -> None:
        """A change that took in a worker ready only after it began: that worker's whole start by phase,
        and how far into the change it was ready. A replacement asked for an earlier loss may have been
        nearly ready when this one began: its start is then mostly not this change's wait."""
        change["worker_start_s"], change["worker_ready_after_s"] = self._new_worker(results, since)

    def _close_change_without_a_step(self, results: list[Report]) -> None:
        """A recovery with no step left to run (a member lost in the final save): its stall lasts
        until the recovered generation ended, and nothing was recomputed."""
        change = self.pending_change
        since, reached = change.pop("_since"), change.pop("reached", None)
        _count_lost_steps(change, reached)
        change["recomputed_steps"] = change["lost_steps"]  # no step was in flight
        change["failed_at"] = round(since, 4)
        change["stall_s"] = round(max(r.ended_at for r in results) - since, 4)
        change["to_next_step_done_s"] = change["first_step_s"] = None  # there is no next step
        self._add_new_worker(change, results, since)
        self._file_pending()

    def _file_pending(self) -> None:
        """The pending change, closed, goes to the recoveries or the reconfigurations."""
        change = self.pending_change
        change.pop("_unheard", None)
        (self.recoveries if change.pop("_kind") == "recovery" else self.reconfigurations).append(change)
        self.pending_change = None

    def add_checkpoint_log(self, rows) -> list:
        """Sample records saved with checkpoints: they fill in ranks whose own report was lost. Those
        of steps before the job's first (a checkpoint of the run it resumed) are not this job's.
        Returns the rows booked."""
        first = self.samples.first_step()
        booked = [row for row in rows if first is None or row[1] >= first]
        self.samples.add_rows(booked)
        return booked

    def add_earlier_change(self, kind: str, change: dict) -> None:
        """A recovery or reconfiguration an earlier coordinator of this job measured (its
        change_measured events): the summary counts the whole job's changes."""
        (self.recoveries if kind == "recovery" else self.reconfigurations).append(change)

    def add_earlier_rows(self, rows) -> None:
        """Sample records an earlier coordinator of this job booked (its generation_end events): a
        replacement's books begin where its predecessor's stood, and the summary counts the whole job."""
        self.samples.add_rows(rows)

    def begin_change(self, kind: str, since: float, generation: int | None = None, **fields) -> None:
        """A change still pending (its generation ended before its first step) is replaced by this
        one, which stands for both."""
        self.pending_change = {"_kind": kind, "_since": since, **fields}
        self.pending_generation, self.pending_stepped_at = generation, None

    def words_awaited(self) -> tuple[int, tuple[str, ...]] | None:
        """The pending recovery's failed generation and its lost members whose last words (the steps
        they had done) were not heard when it began; None when none is awaited."""
        return self.pending_change.get("_unheard") if self.pending_change is not None else None

    def last_words_heard(self, generation: int, words: dict[str, int]) -> None:
        """`words` (actor id -> steps done) of `generation`'s lost, heard since the pending recovery
        began: a standby can start it before a dead worker's beat process is read (46 ms once)."""
        awaited = self.words_awaited()
        if awaited is None or awaited[0] != generation:
            return
        heard = [words[a] for a in awaited[1] if a in words]
        known = [] if self.pending_change["reached"] is None else [self.pending_change["reached"]]
        self.pending_change["reached"] = max(known + heard) if known or heard else None
        unheard = tuple(a for a in awaited[1] if a not in words)
        self.pending_change["_unheard"] = (generation, unheard) if unheard else None

    def restored(self, generation: int, step: int) -> None:
        """`generation` restored a checkpoint of `step` (rank 0's note): the step its change restarted
        from, which a start over that read the job's resumed checkpoint (checkpoint.resume) planned as 0."""
        change = self.pending_change
        if change is None or generation != self.pending_generation:
            return
        over = change.get("source") == "restart"
        if change.get("step") is None or over:
            change["step"] = step
            if self.world_size_history and (self.world_size_history[-1][0] < 0 or over):
                self.world_size_history[-1][0] = step

    def generation_stepped(self, generation: int, at: float) -> None:
        """Rank 0's note that `generation`'s first step is done, heard at `at` (epoch seconds)."""
        if self.pending_change is not None and generation == self.pending_generation:
            self.pending_stepped_at = at

    def _close_change_of_a_lost_generation(self, results: list[Report]) -> None:
        """A change whose generation trained, then lost every member before reporting (a second node
        lost, say): it is kept with what the coordinator saw itself, the step it restarted from, when
        rank 0 said its first step was done and the workers it waited for; when that step began is not
        known."""
        change = self.pending_change
        since = change.pop("_since")
        _count_lost_steps(change, change.pop("reached", None))
        change["failed_at"] = round(since, 4)
        change["stall_s"] = None
        change["to_next_step_done_s"] = round(self.pending_stepped_at - since, 4)
        change["first_step_s"] = None  # its start is not known
        self._add_new_worker(change, results, since)
        self._file_pending()

    def summary(self, param_count: int | None, end_step: int | None = None, memory: dict | None = None) -> dict:
        """`end_step`: the job ended there (stopped on request) rather than at `steps`. `memory`: rank
        0's engine memory report at the end (its model state's bytes)."""
        first = self.samples.first_step() or 0  # a resumed job starts at its checkpoint
        samples = self.samples.counts(first, self.steps if end_step is None else end_step)
        return {
            "steps": len(self.samples),
            "resumed_from_step": first,
            # what a step waited for the store at a save (the final weights' save aside)
            "checkpoint_stall_s_median": statistics.median(self.checkpoint_stalls) if self.checkpoint_stalls else None,
            "checkpoint_stall_s_max": max(self.checkpoint_stalls) if self.checkpoint_stalls else None,
            "checkpoint_errors": self.checkpoint_errors,
            "checkpoints_skipped": self.checkpoints_skipped,
            "warnings": self.warnings,
            "final_loss": self.last_loss,
            "final_metrics": self.last_metrics,
            "loss_curve": sorted(self.loss_curve.items()),
            # [step, eval loss] of each evaluation (the weights after that step), and each one whole
            "eval_curve": [[step, self.evals[step]["loss"]] for step in sorted(self.evals)],
            "evals": [self.evals[step] for step in sorted(self.evals)],
            "final_eval": self.evals[max(self.evals)] if self.evals else None,
            "step_time_curve": sorted((step, round(s, 5)) for step, (s, _) in self.step_seconds.items()),
            "step_end_curve": sorted((step, round(t, 4)) for step, t in self.step_ends.items()),  # epoch seconds
            "start": self.start,
            # of each step's time, its commit (replicas to the buddy) and checkpoint save
            "protect_time_curve": sorted((step, round(p, 5)) for step, (_, p) in self.step_seconds.items()),
            "global_batch": self.global_batch,
            **samples,  # samples_consumed, duplicate_samples, skipped_samples
            # a resumed job's first generation starts at its checkpoint, known once it was read
            "world_size_history": [[first, n] if i == 0 and s == 0 else [s, n]
                                   for i, (s, n) in enumerate(self.world_size_history)],
            "recoveries": self.recoveries,
            "reconfigurations": self.reconfigurations,
            # over the steps that stand, on one rank's clock (step_seconds: not every rank's every step, 10^8
            # floats at 1,024 ranks over 100,000 steps)
            "step_time_s_median": statistics.median(t for t, _ in self.step_seconds.values()) if self.step_seconds else None,
            "param_count": param_count,
            # parameters, gradients and optimizer state in rank 0's engine (its replicas not counted)
            "engine_bytes_per_rank": sum(memory.get(k, 0) for k in ("params", "grads", "optimizer")) if memory else None,
            "time_to_first_step_s": None if self.first_step_at is None else round(self.first_step_at - self.started_at, 3),
        }


def steps_reached(reports, last_words: dict[str, int]) -> int | None:
    """The steps a generation that failed had done: what each participant that lived reported, and
    what each lost one's beat process said as its process ended; None when nobody said (every member
    lost with its node): never a guess."""
    known = [r.outcome.step for r in reports if r.outcome.kind != OutcomeKind.DEAD]
    known += [last_words[r.outcome.actor_id] for r in reports
              if r.outcome.kind == OutcomeKind.DEAD and r.outcome.actor_id in last_words]
    return max(known) if known else None


def _count_lost_steps(change: dict, reached: int | None) -> None:
    """A recovery's done steps lost (the workers had reached `reached`) and the steps it ran again,
    those and the one in flight; None where the step it restarted from is not known (a checkpoint
    whose step no member logged)."""
    known = reached is not None and change.get("step") is not None
    change["lost_steps"] = max(0, reached - change["step"]) if known else None
    change["recomputed_steps"] = change["lost_steps"] + 1 if known else None


def _slowest_phases(results: list[Report]) -> dict:
    """Each phase of entering a generation: its longest time over the participants."""
    phases = [r.phases_s for r in results]
    return {k: max(p.get(k, 0.0) for p in phases) for k in sorted(set().union(*phases))}
