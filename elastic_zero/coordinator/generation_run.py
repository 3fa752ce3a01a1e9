"""A generation while it runs, as the coordinator sees it: its plan, the train calls still out, the
reports that came back, and when it was first seen to fail. Started by the coordinator's loop,
ended when no call is out; a participant given up on (silent, stuck) is counted dead here, its
report no longer awaited."""

from __future__ import annotations

import dataclasses
import time

import ray

from elastic_zero.coordinator.death_causes import memory_kill
from elastic_zero.protocol import Outcome, OutcomeKind, Report, pack_plan


class GenerationRun:
    def __init__(self, plan, pool, completions, taken_over: dict | None = None) -> None:
        """Each participant of `plan` is asked to train it (a call on its handle in `pool`). Or the
        generation was started by a lost coordinator and is `taken_over` (the participants' take_over()
        calls in flight -> actor id): their answers are its reports."""
        self.plan = plan
        self.taken_over = taken_over is not None
        self.results: dict[str, Report] = {}
        self.failure_seen_at: float | None = None  # a participant failed (monotonic)
        self._calls: dict = dict(taken_over or {})  # train() (or take_over()) in flight -> actor id
        if taken_over is None:
            shared = pack_plan(plan)  # serialized once: pickling a plan of N members for each of N calls is O(N^2)
            for actor_id in plan.participants:
                self._calls[pool.handle(actor_id).train.remote(shared)] = actor_id
        for ref in self._calls:
            completions.watch(ref)

    @property
    def number(self) -> int:
        return self.plan.number

    def training(self) -> list[str]:
        """The participants whose reports are still awaited."""
        return list(self._calls.values())

    def over(self) -> bool:
        return not self._calls

    def owns(self, ref) -> bool:
        return ref in self._calls

    def collect(self, ref) -> tuple[str, Report, dict | None]:
        """The report `ref` (owns(ref)) brought: (actor id, report, death), `death` None unless the call
        raised (its worker died), else {"cause": ...} where Ray's memory monitor killed it, or {}."""
        actor_id = self._calls.pop(ref)
        death = None
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the actor died
            oom = memory_kill(str(exc))
            death = {"cause": oom} if oom else {}
            report = Report(Outcome(actor_id, OutcomeKind.DEAD, error=oom or str(exc)[:300]), ended_at=time.time())
        if self.taken_over and (report is None or report.generation != self.number):
            report = _not_in_it(actor_id, report, self.number)
        self.results[actor_id] = report
        return actor_id, report, death

    def count_dead(self, actor_ids, error: str, last_sign: dict[str, float], now: float) -> None:
        """Participants given up on before their reports came: dead, from their last sign of life
        (`last_sign`, monotonic; `now` too), their reports no longer awaited."""
        for ref, actor_id in list(self._calls.items()):
            if actor_id in actor_ids:
                del self._calls[ref]
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
        if self.failure_seen_at is None or not self._calls or now - self.failure_seen_at < timeout_s:
            return []
        self.failure_seen_at = now
        return self.training()


def _not_in_it(actor_id: str, report: Report | None, number: int) -> Report:
    """A participant of a taken-over generation whose report is of an earlier one (the lost coordinator
    never reached it with this plan) or of none: it failed in this one, holding what it held then."""
    if report is None:
        return Report(Outcome(actor_id, OutcomeKind.FAILED, error="it trained no generation"), ended_at=time.time(),
                      generation=number)
    if report.outcome.kind == OutcomeKind.DEAD:
        return report
    outcome = dataclasses.replace(report.outcome, kind=OutcomeKind.FAILED,
                                  error=f"its last generation was {report.generation}, not {number}")
    return dataclasses.replace(report, outcome=outcome, generation=number, log=(), ward_log=())
