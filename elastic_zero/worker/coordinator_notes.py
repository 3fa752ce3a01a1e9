"""What a worker tells its coordinator, fire and forget (the coordinator never answers, and training
never waits for it): rank 0's progress, evaluations, cadence and restores; any rank's commits (rank
0 commits) and Python warnings. A worker without a coordinator (a test's) tells nobody: every
note is then dropped."""

from __future__ import annotations

import time

from elastic_zero.worker.node_duties import coordinator_handle

PROGRESS_EVERY_S = 0.5  # how often rank 0 tells the coordinator its step and loss


class CoordinatorNotes:
    def __init__(self, actor_id: str, coordinator: str | None, namespace: str | None) -> None:
        self._actor_id, self._coordinator, self._namespace = actor_id, coordinator, namespace
        self._progress_told_at = 0.0

    def __bool__(self) -> bool:
        """Whether there is a coordinator to tell."""
        return bool(self._coordinator)

    def _tell(self, method: str, *args) -> None:
        """One note; dropped while there is no coordinator (it was lost, and its replacement has not
        taken this worker over yet: it hears how the generation went from the worker's report)."""
        try:
            coordinator = coordinator_handle(self._coordinator, self._namespace)
        except ValueError:  # no actor of that name now
            return
        getattr(coordinator, method).remote(*args)

    def progress(self, generation: int, step_count: int, last: bool, report: dict) -> None:
        """Rank 0's step: that the generation stepped, once, and its step and loss at most every
        PROGRESS_EVERY_S (and at the `last` step): the live view, the progress line, the metrics."""
        if len(report["step_times"]) == 1:
            self._tell("generation_stepped", generation)
        now = time.time()
        if now - self._progress_told_at >= PROGRESS_EVERY_S or last:
            self._progress_told_at = now
            told = report.get("losses_told", 0)  # the trackers get every step's loss, a note's worth at a time
            report["losses_told"] = len(report["losses"])
            self._tell("progress_note", generation, step_count, report["last_loss"], report["step_times"][-1], now,
                       report["checkpoints"][-1] if report["checkpoints"] else None, tuple(report["losses"][told:]))

    def evaluated(self, generation: int, result: dict) -> None:
        self._tell("eval_note", generation, result)

    def cadence(self, generation: int, summary: dict) -> None:
        self._tell("replicas_note", generation, summary)

    def restored(self, generation: int, directory: str, step: int) -> None:
        self._tell("restored_note", generation, directory, step)

    def committed(self, directory: str) -> None:
        self._tell("checkpoint_note", self._actor_id, directory)

    def warning(self, text: str) -> None:
        self._tell("worker_warning", self._actor_id, text)
