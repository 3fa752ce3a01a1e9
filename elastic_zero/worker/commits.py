"""How a worker commits a step: its shard copied to host memory and swapped with the buddy's over
the host group (replication.py), and the step's sample records kept once the swap arrived. One per
worker, owned by its Trainer (trainer.py), which hands it the engine of the moment."""

from __future__ import annotations

import time
import warnings

import torch

from elastic_zero.plan.batches import rank_positions
from elastic_zero.protocol import GenerationPlan
from elastic_zero.worker.replication import InFlight
from elastic_zero.zero import ShardState


class StepCommits:
    def __init__(self, spec, cadence, replicator, replicas, records, groups, device, tell_cadence=None) -> None:
        """`cadence`: how often a step commits (cadence_meter.py); `replicator`: the swaps with the
        buddy; `replicas`: what this rank holds (replica.py); `records`: what the next checkpoint
        carries (checkpoint_records.py); `groups`: the generation's groups; `tell_cadence(generation,
        summary)`: rank 0 tells the coordinator the cadence agreed (None: nobody to tell)."""
        self._spec, self.cadence, self.replicator, self.replicas = spec, cadence, replicator, replicas
        self._records, self._groups, self._device, self._tell_cadence = records, groups, device, tell_cadence
        self._planned = True  # the current generation's plan keeps replicas (they fit its workers' memory)

    def plan_keeps_replicas(self, planned: bool) -> None:
        """The generation entered keeps replicas, or its plan found no room for them."""
        self._planned = planned

    @property
    def replicating(self) -> bool:
        """Whether this generation keeps replicas in memory (elastic.replicate_every = 0, or a plan
        whose workers have no room for them: none, so no step ever commits, and a loss is recovered
        from the latest checkpoint)."""
        return self._spec.elastic.replicate_every != 0 and self._planned

    def due(self, step_count: int) -> bool:
        """Whether the step that brings the count to `step_count` commits (safe points aside, which
        commit too): every `replicate_every` steps (auto: as the ranks agreed, cadence_meter.py), and the last."""
        every = self.cadence.every
        return self.replicating and (step_count % every == 0 or step_count == self._spec.train.steps)

    def agree_cadence(self, plan: GenerationPlan, rank: int, comm, report: dict) -> None:
        """At an auto cadence's deciding step (the same on every rank: the generation's step count),
        every rank takes the largest cadence proposed: the slowest pair's copies stall every rank's
        step alike. Rank 0 tells the coordinator."""
        if not self.replicating or not self.cadence.deciding(len(report["step_times"])):
            return
        proposed = torch.tensor([self.cadence.proposal()], dtype=torch.float64, device=self._device)
        comm.all_reduce(proposed, op="max")
        self.cadence.agree(float(proposed[0]))
        if rank == 0 and self._tell_cadence is not None:
            self._tell_cadence(plan.number, self.cadence.summary())

    def commit_now(self, plan: GenerationPlan, engine, snapshot: ShardState | None = None) -> None:
        """Commit now, entering a generation: snapshot this rank's shard of `engine` (or take
        `snapshot`, a host copy of it) and swap replicas with the buddy, waiting for the swap."""
        if not self.replicating:
            return
        self.start(plan, None, engine, snapshot)
        self.finish(plan, None)

    def start(self, plan: GenerationPlan, report: dict | None, engine, snapshot: ShardState | None = None) -> float:
        """Copy this rank's shard to host memory and start swapping it with the buddy's over the host
        group. The sample records since the last commit travel along, so a lost rank's record survives.
        Returns the seconds the step spent copying, when the step made the copy as it updated."""
        copied, copy_s, step_copy_s = None, 0.0, 0.0
        if snapshot is None:  # the copy the step made as it updated, or one made now
            taken = engine.take_host_copy()
            if taken is not None:
                snapshot, copied, copy_s = taken
                step_copy_s = copy_s
            else:
                began = time.perf_counter()
                snapshot, copied = engine.host_shard_state()
                step_copy_s = time.perf_counter() - began
        rows = report["uncommitted"] if report else []
        if report:
            report["uncommitted"] = []
            self._check_held(plan)
        # (the snapshot's own step: a recovery commits its new layout before the engine takes it)
        self.replicator.start(self._groups.host_comm(), int(snapshot.scalars["step"]), snapshot, copied,
                              plan.generation.buddies, rows, step_copy_s)
        return copy_s

    def _check_held(self, plan: GenerationPlan) -> None:
        """A step's commit in a layout it committed in before: the older steps went when the step
        before's all-reduce was read (trainer.py reads it before the copy), so one is left. The memory
        plan counts two of each (plan/memory.py): more would be beyond it, which is told once."""
        if self.replicas.generation == plan.number and len(self.replicas.current.own) > 1:
            warnings.warn(f"replicas: {len(self.replicas.current.own) + 1} snapshots of a rank's shard held as a "
                          f"step's is made, where the memory plan counts 2")

    def finish(self, plan: GenerationPlan, report: dict | None) -> float:
        """Wait for the swap in flight, if any: its step is now committed. Returns the seconds waited."""
        waited = time.perf_counter()
        flight = self.replicator.finish()
        waited = time.perf_counter() - waited
        if flight is not None:
            self.committed(plan, flight, report)
        return waited

    def committed(self, plan: GenerationPlan, flight: InFlight, report: dict | None) -> None:
        """The swap `flight` arrived: its step is committed."""
        ward, ward_log = flight.result
        self.cadence.commit_done(flight.snapshot.nbytes(), *flight.times())
        built_from = plan.previous.number if plan.previous is not None else None
        self.replicas.add(plan.number, built_from, flight.step, flight.snapshot, ward)
        if report is not None:
            self._keep(plan, report, flight.rows)
            if ward_log is not None:
                report["ward_log"].extend(tuple(row) for row in ward_log.tolist())

    def _keep(self, plan: GenerationPlan, report: dict, rows: list) -> None:
        """The sample records of the steps a commit made safe are kept: into the report and the next
        checkpoint."""
        self._records.committed(plan.number, rows)
        report["log"].extend(rows)

    def keep_step_records(self, plan: GenerationPlan, report: dict, step: int, world: int, rank: int) -> None:
        """Without replicas (nothing commits), a step's sample records are kept once its closing
        all-reduce passed: every rank had computed its share. As a commit keeps them, with the
        ward's record too, which the all-reduce witnessed: a lost rank's steps are still told."""
        rows, report["uncommitted"] = report["uncommitted"], []
        self._keep(plan, report, rows)
        if world > 1:
            ward = plan.generation.buddies.index(rank)
            positions = rank_positions(step, self._spec.train.global_batch, world, ward)
            report["ward_log"].append((step, ward, positions.start, len(positions)))
