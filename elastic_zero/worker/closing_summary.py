"""A step's closing summary (losses.step_summary, all-reduced), read back a step late.

Read at once, on a GPU, it makes the host wait for the step's backward and all-reduce; the device
then idles while the host reads it, decides and queues the update and the next step's forward. So
the loop reads step s's summary during step s + 1, after queuing that step's forward and backward:
its all-reduce finished long before, and the host's per-step work runs while the device computes.
The ranks act on what it says (a safe point, a checkpoint asked for) one step later, all alike.
It is read at once where something durable follows: a save (a loss that is not finite fails the
job before its weights are kept) and the generation's end; and before a step's host copy for a
commit, so that the older replicas go first and a rank holds two steps' copies at most, as the
memory plan counts (plan/memory.py). On a GPU the default cadence commits every tens of steps.

What its all-reduce witnessed is kept with it: every rank had then committed the step in
`committed_through` (or kept no replicas), so the replicas before it may go when it is read, and
no later commit counts as witnessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from elastic_zero.losses import check_batch_totals, read_step_summary
from elastic_zero.worker.entry import committed_key
from elastic_zero.zero.abortable import GroupAborted


@dataclass
class ClosingSummary:
    step: int  # the step (its index) it closed
    reduced: torch.Tensor  # on the step's device; all-reduced (on CUDA, perhaps not yet)
    names: list  # the loss's metric names, sorted
    committed: bool  # every rank entered its all-reduce after a commit in this layout (or without replicas)
    committed_through: int | None  # the latest step this rank had committed in the layout then
    first: bool  # the generation's first step
    totals: torch.Tensor | None = None  # the step's batch totals, all-reduced (losses.batch_totals), if asked
    _host: torch.Tensor | None = None  # CUDA: a pinned copy of both, complete when _copied is
    _copied: object | None = None  # CUDA: an event after the copy
    _values: list | None = field(default=None, repr=False)

    @classmethod
    def after_all_reduce(cls, reduced: torch.Tensor, step: int, names: list, committed: bool,
                         committed_through: int | None, first: bool,
                         totals: torch.Tensor | None = None) -> "ClosingSummary":
        """Made once `reduced` (and `totals`) were all-reduced (queued, on CUDA): a copy to pinned
        host memory is queued behind it, so that reading it later waits for nothing else."""
        summary = cls(step, reduced, names, committed, committed_through, first, totals)
        if reduced.device.type == "cuda":
            both = reduced if totals is None else torch.cat([reduced, totals])
            summary._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            summary._host.copy_(both, non_blocking=True)
            summary._copied = torch.cuda.Event()
            summary._copied.record()
        return summary

    @property
    def read(self) -> bool:
        return self._values is not None

    def known_complete(self) -> bool:
        """Whether its all-reduce is known to have completed on every rank: on the CPU (gloo) it had
        before the summary was made. On CUDA a read that finds the groups not aborted tells (an
        aborted group's all-reduce ends early, its values unknown, and the copy behind it completes
        all the same: SummaryReader.read checks)."""
        return self._copied is None

    def values(self) -> list:
        """The all-reduced slots (see losses.step_summary), waiting for the device if need be."""
        return self._read()[: self.reduced.numel()]

    def total_values(self) -> list | None:
        """The step's batch totals (losses.check_batch_totals), if it has them."""
        return None if self.totals is None else self._read()[self.reduced.numel():]

    def _read(self) -> list:
        if self._values is None:
            if self._copied is not None:
                self._copied.synchronize()
                self._values = self._host.tolist()
            else:
                self._values = self.reduced.tolist() + ([] if self.totals is None else self.totals.tolist())
        return self._values

    # what the ranks asked for in it (sums over ranks: any rank asking makes it so on every rank)
    @property
    def safe_point_asked(self) -> bool:
        return self.values()[0] > 0

    @property
    def checkpoint_asked(self) -> bool:
        return self.values()[-2] > 0

    @property
    def save_busy(self) -> bool:
        """A rank's last save was still being written when a periodic save came due at this step."""
        return self.values()[-1] > 0


class SummaryReader:
    """Acts once on each closing summary read: what its all-reduce witnessed, and the loss."""

    def __init__(self, replicas, pins, commits, writer, store, finite_loss: bool, aborted) -> None:
        """The trainer's parts it acts on: `replicas` (replica.LayoutReplicas), `pins`
        (pinned_layouts.PinnedLayouts), `commits` (commits.StepCommits), `writer` (the checkpoint
        writer, or None), `store` (the job's store); `finite_loss`: a loss that is not finite is an
        error; `aborted()`: whether the generation's groups were aborted."""
        self._replicas, self._pins, self._commits, self._writer, self._store = replicas, pins, commits, writer, store
        self._finite_loss, self._aborted = finite_loss, aborted

    def read(self, plan, rank: int, world: int, summary: ClosingSummary | None, report: dict) -> None:
        """Every rank got to the step's all-reduce: a commit it had made then is held everywhere (the
        older replicas and the layout before go), and without replicas the step's sample records are
        kept. Its loss goes into the report; one that is not finite is a ValueError naming the step.
        None, or read before: nothing to do."""
        if summary is None or summary.read:
            return
        values = summary.values()
        if not summary.known_complete() and self._aborted():  # (CUDA) an aborted all-reduce ends early, its
            raise GroupAborted(f"generation {plan.number} was aborted")  # values unknown: nothing is confirmed by it
        if summary.totals is not None:  # before the loss: weights that do not add up make it nan
            check_batch_totals(summary.total_values(), summary.step)
        if summary.committed:  # every rank got there after a commit in this layout: it is complete in memory
            self._replicas.confirmed(summary.committed_through)
            if not self._commits.replicating and self._replicas.generation >= 0:  # (a plan without room for them)
                self._replicas.clear()  # those of the layouts before go too
                self._pins.dropped()
            self._pins.settle(self._replicas.earlier is not None or bool(self._writer and self._writer.busy()))
            if rank == 0 and plan.leaving and summary.first:
                self._store.set(committed_key(plan), "1")  # the leavers may go
        self._keep(plan, rank, world, summary, report)
        report["last_loss"], report["last_metrics"] = read_step_summary(
            values, summary.names, world, summary.step, finite=self._finite_loss, finite_metrics=True)
        report["losses"].append((summary.step, round(report["last_loss"], 6)))  # every rank: one may be lost

    def salvage(self, plan, rank: int, world: int, summary: ClosingSummary | None, report: dict) -> None:
        """A generation failed after `summary`'s step and before it was read: what it witnessed still
        holds where its all-reduce is known to have completed (the CPU's), so its sample records are
        kept and its loss told, as when it is read. Nothing is released: the recovery reads the replicas."""
        if summary is None or summary.read or not summary.known_complete():
            return
        values = summary.values()
        try:  # a step whose batch weights or metrics do not add up is no step to keep (the next generation
            if summary.totals is not None:  # says so again, at its first read)
                check_batch_totals(summary.total_values(), summary.step)
            loss, metrics = read_step_summary(values, summary.names, world, summary.step)
        except ValueError:
            return
        self._keep(plan, rank, world, summary, report)
        report["last_loss"], report["last_metrics"] = loss, metrics
        report["losses"].append((summary.step, round(loss, 6)))

    def _keep(self, plan, rank: int, world: int, summary: ClosingSummary, report: dict) -> None:
        if not self._commits.replicating:
            self._commits.keep_step_records(plan, report, summary.step, world, rank)
