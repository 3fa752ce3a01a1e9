"""A generation while it runs, as the coordinator sees it: its plan, its participants' train calls,
the reports that came back (as a call's answer, or handed in through the store by a standing call:
wire/standing_calls.py), and when it was first seen to fail. Started by the coordinator's loop,
ended when no report is awaited; a participant given up on (silent, stuck) is counted dead here,
its report no longer awaited."""

from __future__ import annotations

import dataclasses
import time

import ray

from elastic_zero.coordinator.death_causes import memory_kill
from elastic_zero.protocol import Outcome, OutcomeKind, Report, pack_plan
from elastic_zero.wire.standing_calls import take_handed_in


class GenerationRun:
    def __init__(self, plan, pool, completions, standing: dict | None = None, taken_over: dict | None = None) -> None:
        """Each participant of `plan` trains it: on its call standing after the generation before
        (`standing`: actor id -> that call, in flight; it reads the plan from the store, handed out by
        the caller: `packed`), else on a new one, which stands after this generation
        (wire/standing_calls.py). Or the generation was started by a lost coordinator and is
        `taken_over` (the participants' take_over() calls in flight -> actor id): their answers are
        its reports."""
        self.plan = plan
        self.taken_over = taken_over is not None
        self.results: dict[str, Report] = {}
        self.failure_seen_at: float | None = None  # a participant failed (monotonic)
        self._calls: dict = dict(taken_over or {})  # train() (or take_over()) in flight -> actor id
        self.packed = None
        if taken_over is None:
            self.packed = pack_plan(plan)  # serialized once: pickling a plan of N members for each of N calls is O(N^2)
            standing = standing or {}
            for actor_id in plan.participants:
                ref = standing.get(actor_id)
                if ref is None:
                    ref = pool.handle(actor_id).train.remote(self.packed, True)
                    completions.watch(ref)
                self._calls[ref] = actor_id
        else:
            for ref in self._calls:
                completions.watch(ref)
        self._awaited = set(self._calls.values())  # the participants whose reports have not come

    @property
    def number(self) -> int:
        return self.plan.number

    def training(self) -> list[str]:
        """The participants whose reports are still awaited."""
        return list(self._awaited)

    def over(self) -> bool:
        return not self._awaited

    def owns(self, ref) -> bool:
        return ref in self._calls

    def collect(self, ref) -> tuple[str, Report, dict | None] | None:
        """The report `ref` (owns(ref)) brought: (actor id, report, death), `death` None unless the call
        raised (its worker died), else {"cause": ...} where Ray's memory monitor killed it, or {}. None
        where its participant's report came through the store already: its call no longer stands."""
        actor_id = self._calls.pop(ref)
        if actor_id not in self._awaited:
            return None
        self._awaited.discard(actor_id)
        death = None
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the actor died
            oom = memory_kill(str(exc))
            death = {"cause": oom} if oom else {}
            report = Report(Outcome(actor_id, OutcomeKind.DEAD, error=oom or str(exc)[:300]), ended_at=time.time())
        if report is None or report.generation != self.number:
            # a standing call that ended before it read this plan (the store broke), or a taken-over
            # participant the lost coordinator never reached with it
            report = _not_in_it(actor_id, report, self.number)
        self.results[actor_id] = report
        return actor_id, report, death

    def take_handed_in(self, store) -> list[tuple[str, Report]]:
        """The reports handed in through the store since the last look (standing calls): (actor id,
        report) of each participant still awaited."""
        came = []
        for report in take_handed_in(store, self.number):
            actor_id = report.outcome.actor_id
            if actor_id in self._awaited:
                self._awaited.discard(actor_id)
                self.results[actor_id] = report
                came.append((actor_id, report))
        return came

    def standing_after(self) -> dict:
        """The calls that stand after this generation (call -> actor id): those of the participants
        whose reports came through the store, their calls still in flight."""
        if self.taken_over:
            return {}
        return {ref: actor_id for ref, actor_id in self._calls.items()
                if actor_id in self.results and self.results[actor_id].outcome.kind not in (OutcomeKind.DEAD,
                                                                                             OutcomeKind.LEFT)}

    def count_dead(self, actor_ids, error: str, last_sign: dict[str, float], now: float) -> None:
        """Participants given up on before their reports came: dead, from their last sign of life
        (`last_sign`, monotonic; `now` too), their reports no longer awaited."""
        for actor_id in actor_ids:
            if actor_id in self._awaited:
                self._awaited.discard(actor_id)
                ended_at = time.time() - (now - last_sign[actor_id])
                self.results[actor_id] = Report(Outcome(actor_id, OutcomeKind.DEAD, error=error), ended_at=ended_at)

    def failed(self, now: float) -> bool:
        """A participant died or its collective failed: whether this is the first time it is seen."""
        if self.failure_seen_at is not None:
            return False
        self.failure_seen_at = now
        return True

    def unresponsive(self, now: float, timeout_s: float) -> list[str]:
        """The participants still out `timeout_s` after the generation failed: hung (alive, not
        answering). Each is named once a `timeout_s`: their deaths arrive as their calls complete."""
        if self.failure_seen_at is None or not self._awaited or now - self.failure_seen_at < timeout_s:
            return []
        self.failure_seen_at = now
        return self.training()


def _not_in_it(actor_id: str, report: Report | None, number: int) -> Report:
    """A participant whose report is of an earlier generation (a standing call that ended before it read
    this plan; a taken-over participant the lost coordinator never reached with it) or of none: it
    failed in this one, holding what it held then."""
    if report is None:
        return Report(Outcome(actor_id, OutcomeKind.FAILED, error="it trained no generation"), ended_at=time.time(),
                      generation=number)
    if report.outcome.kind == OutcomeKind.DEAD:
        return report
    outcome = dataclasses.replace(report.outcome, kind=OutcomeKind.FAILED,
                                  error=f"its last generation was {report.generation}, not {number}")
    return dataclasses.replace(report, outcome=outcome, generation=number, log=(), ward_log=())
