"""The generations a job runs, as the coordinator keeps them: the one running (generation_run.py),
the plan last started, and how the last one ended (what the next recovery is planned and counted
from). Each is started, aborted and ended here with what its workers must be told (the store's end
key, generation_ends.py) and what the job's record keeps of it."""

from __future__ import annotations

import dataclasses
import time

from elastic_zero.coordinator.books import steps_reached
from elastic_zero.coordinator.commit_reads import checkpoint_candidates
from elastic_zero.coordinator.drill_kills import DrillKills
from elastic_zero.coordinator.generation_run import GenerationRun
from elastic_zero.protocol import Outcome, OutcomeKind, Report, Source
from elastic_zero.wire.generation_ends import announce_end
from elastic_zero.wire.standing_calls import HANDED_IN_POLL_S, hand_out


class Generations:
    def __init__(self, spec, pool, watch, record, store, completions) -> None:
        self._spec, self._pool, self._watch, self._record = spec, pool, watch, record
        self._store, self._completions = store, completions
        self._drill_kills = DrillKills(store, spec.faults)
        self.running: GenerationRun | None = None
        # the train calls standing after the generation that ended last (wire/standing_calls.py): call ->
        # actor id; `_standing_after`: that generation's number
        self._standing: dict = {}
        self._standing_after: int | None = None
        self._next_look = 0.0  # when the store is next looked at for reports handed in (monotonic)
        self.last_plan = None
        self.last_end: dict[str, Report] = {}  # actor id -> its report of the generation that ended last

    def drills_fired_before(self, restarts: int) -> None:
        """A restarted coordinator's: the drills that killed its predecessors fired (drill_kills.py)."""
        self._drill_kills.fired_before(restarts)

    def training(self) -> list[str]:
        """The running generation's participants whose reports are still awaited."""
        return self.running.training() if self.running is not None else []

    def start(self, plan) -> None:
        """`plan` starts. A checkpoint generation is given the commits it may restore, newest first,
        their sample records read now (pruning may remove them while it trains): a ValueError where
        there is none to read."""
        if plan.source == Source.CHECKPOINT:
            candidates, logs = checkpoint_candidates(self._spec.checkpoint.uri)
            self._record.restore_candidates(plan.number, logs)
            plan = dataclasses.replace(plan, checkpoints=candidates)
        elif plan.source == Source.INIT and self._spec.checkpoint.resume and self._record.committed_directories():
            # a restarted coordinator, its workers gone, resumes the job's latest checkpoint: the steps its
            # predecessor's last generation trained are in that commit's records only
            # (its own commits' records of its own steps: a job that resumed another run's checkpoint carries
            # that run's records on)
            own, first = set(self._record.committed_directories()), self._record.first_step()
            try:
                logs = checkpoint_candidates(self._spec.checkpoint.uri)[1]
            except ValueError:  # none committed any more: the generation starts afresh
                logs = []
            except OSError as exc:  # the workers' own read may still succeed: only the counting lacks them
                self._record.warn(f"could not read the sample records of the job's checkpoints: {exc}")
                logs = []
            self._record.restore_candidates(plan.number, [(d, [r for r in rows if r[1] >= first])
                                                          for d, rows in logs if d in own])
        last = self.last_end
        failed_at = reached = unheard = None
        if plan.source in (Source.SNAPSHOT, Source.CHECKPOINT, Source.RESTART):
            failed_at = min(self._drill_kills.new_times() + [r.ended_at for r in last.values()] or [time.time()])
            words = self._watch.last_words(self.last_plan.number)
            reached = steps_reached(last.values(), words)
            unheard = tuple(sorted(a for a, r in last.items() if r.outcome.kind == OutcomeKind.DEAD and a not in words))
            unheard = (self.last_plan.number, unheard) if unheard else None
        resume = self._spec.checkpoint.resume if plan.source == Source.INIT else None
        standing = {actor_id: ref for ref, actor_id in self._standing.items()}
        calls = sum(1 for a in plan.participants if a not in standing)
        self._record.generation_starts(plan, last, failed_at, reached, resume, calls, unheard)
        self.last_plan = plan
        self._watch.listen_to(plan.participants)
        self.running = GenerationRun(plan, self._pool, self._completions, standing=standing)
        if self._standing:  # those it leaves out read it too, and their calls end
            hand_out(self._store, self._standing_after, self.running.packed)
        self._standing = {}

    def take_handed_in(self, now: float) -> list:
        """The running generation's reports handed in through the store since the last look: (actor id,
        report) each. Looked for every HANDED_IN_POLL_S (`now`: monotonic), one exchange a look."""
        run = self.running
        if run is None or run.taken_over or run.over() or now < self._next_look:
            return []
        self._next_look = now + HANDED_IN_POLL_S
        return run.take_handed_in(self._store)

    def collect(self, ref) -> tuple | None:
        """What the train call `ref`, ended, brought: (actor id, report, death) where the running
        generation awaited it (generation_run.py), else None. A call no running generation awaits (its
        worker left the plan, died or was killed, or lost the store; or was given up on) no longer
        stands."""
        run = self.running
        if run is None or not run.owns(ref):
            self._standing.pop(ref, None)
            return None
        return run.collect(ref)  # (None: it ended after its report came through the store)

    def take_over(self, plan, calls: dict) -> None:
        """The generation a lost coordinator started goes on under this one: `calls` (its participants'
        take_over() in flight -> actor id) bring its reports. Their silence is not counted until the
        next generation: they beat to the lost coordinator's listener until they follow this one."""
        self.last_plan = plan
        self.running = GenerationRun(plan, self._pool, self._completions, taken_over=calls)

    def failed(self) -> None:
        """A participant died or its collective failed: the generation is over. The others are aborted
        now, so that they don't find out one collective (or one timeout) at a time: one store key they
        all wait for; once, as every survivor's report of the failure comes too."""
        if self.running.failed(time.monotonic()):
            announce_end(self._store, self.running.number, aborted=True)

    def kill_unresponsive(self) -> None:
        """A participant still silent a collective timeout after the generation failed is hung (alive
        but not answering): killed, so that it counts as lost and the survivors can recover."""
        if self.running is None:
            return
        for actor_id in self.running.unresponsive(time.monotonic(), self._spec.elastic.collective_timeout_s):
            self._record.log("worker_unresponsive", actor_id=actor_id)
            handle = self._pool.get(actor_id)
            if handle is not None:
                self._pool.kill(handle)

    def ask_one_member(self, method: str, generation) -> None:
        """A safe point or a checkpoint is asked of one member still training: each rank adds its request into
        the step's closing all-reduce (worker/trainer.py), so all act at one step (asking 1,024 took 1.4 s)."""
        running = set(self.training())  # (one found lost is retired at once)
        asked = next((m.actor_id for m in generation.members if m.actor_id in running and m.actor_id in self._pool),
                     None)
        if asked is not None:  # none: the generation is ending, and the next one is planned with what was asked
            getattr(self._pool.handle(asked), method).remote(generation.number)

    def checkpoint_before_leaving(self, generation, leaving) -> None:
        """Workers told to go have nobody to hand their shards to (the state machine's CheckpointNow):
        every member saves the step it reaches next, and training goes on until replacements join
        or the workers go. Without checkpoints, the user is told what will be lost."""
        leaving = [a for a in leaving if any(m.actor_id == a for m in generation.members)]
        if not (self._spec.checkpoint.uri and self._spec.checkpoint.every):
            self._record.log("warning", message=f"{', '.join(leaving)} must leave and no worker can take their shards, "
                                                f"but the job saves no checkpoints (checkpoint.uri, checkpoint.every): "
                                                f"its state since the start goes with them unless replacements join first")
            return
        self._record.log("notice_checkpoint", generation=generation.number, actor_ids=leaving)
        self.ask_one_member("request_checkpoint", generation)

    def end(self) -> GenerationRun:
        """The running generation, over (no call out): its workers are told it ended."""
        run, self.running = self.running, None
        announce_end(self._store, run.number, aborted=False)  # (an abort, said first, stays)
        self._standing, self._standing_after = run.standing_after(), run.number
        return run

    def close(self, run: GenerationRun) -> tuple:
        """What `run`'s reports say goes into the record; they are how it ended. Returns the outcomes
        of those that lived."""
        self.last_end = run.results
        self._record.hear_last_words(self._watch.last_words)  # a recovery's lost, heard late
        return self._record.generation_ended(run.plan, run.results)

    def lost_in_final_save(self, members: list[str], lost: dict) -> tuple:
        """`lost` (actor id -> (when, why)) died in the final save; the other `members`' outcomes stand
        as their generation ended (finished at the last step, holding its replicas). Returns the
        outcomes of those that lived, to recover from."""
        for actor_id, (_, why) in lost.items():
            self._record.log("worker_lost", actor_id=actor_id, during="final_save", error=why)
        now = time.time()
        self.last_end = {a: Report(Outcome(a, OutcomeKind.DEAD, error=lost[a][1]), ended_at=lost[a][0]) if a in lost
                         else dataclasses.replace(self.last_end[a], ended_at=now) for a in members}
        return tuple(r.outcome for r in self.last_end.values() if r.outcome.kind != OutcomeKind.DEAD)
