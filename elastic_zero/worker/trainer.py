"""The worker's state and work: one device, one ZeRO shard, the step loop of a generation, safe
points. Its Ray face is actor.py, which builds it in the worker's own process.

The coordinator calls train(plan) once per generation. train() joins the generation's process
groups (the only place that creates them), moves the shards to the new layout, then steps until
the job ends, a safe point is agreed, or a collective fails. Every step ends with one small
all-reduce that carries the loss and "somebody was asked for a safe point", read during the next
step (closing_summary.py), so all ranks stop at the same step without asking the coordinator.
Every `replicate_every` steps the shard snapshot goes to the buddy's host memory, over the host
group, while the next step computes (replication.py).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from elastic_zero.checkpoint.writer import AsyncCheckpointWriter
from elastic_zero.node_memory import reset_peak
from elastic_zero.losses import batch_totals, batch_weight, checked, step_summary
from elastic_zero.plan.evaluation import eval_due
from elastic_zero.protocol import GenerationPlan, Hello, Outcome, OutcomeKind, Report
from elastic_zero.job.spec import spec_from_dict
from elastic_zero.worker.cadence_meter import CadenceMeter
from elastic_zero.worker.drill_runner import DrillRunner
from elastic_zero.worker.entry import GenerationEntry
from elastic_zero.worker.faults import WorkerStartError, is_communication_failure, is_device_failure
from elastic_zero.worker.generation_gate import GenerationGate, abort_all
from elastic_zero.worker.groups import GenerationGroups
from elastic_zero.worker.coordinator_link import CoordinatorLink
from elastic_zero.worker.coordinator_notes import CoordinatorNotes
from elastic_zero.worker.node_duties import NodeDuties, memory_facts
from elastic_zero.worker.pinned_layouts import PinnedLayouts
from elastic_zero.worker.replica import LayoutReplicas
from elastic_zero.worker.checkpoint_records import CheckpointRecords
from elastic_zero.worker.closing_summary import ClosingSummary, SummaryReader
from elastic_zero.worker.commits import StepCommits
from elastic_zero.worker.replication import Replicator
from elastic_zero.worker.saves import CheckpointSaves
from elastic_zero.worker.start_clock import StartClock
from elastic_zero.worker.start_parts import build_start_parts
from elastic_zero.worker.warnings_relay import relay_warnings
from elastic_zero.zero import TorchComm, ZeroEngine
from elastic_zero.zero.host_memory import large_allocations_to_the_system, release_pinned_cache


class Trainer:
    def __init__(self, spec: dict, actor_id: str, store_host: str, store_port: int, store_secret: bytes,
                 coordinator: str | None = None, namespace: str | None = None, joiner: bool = False,
                 heartbeat_port: int | None = None, start: StartClock | None = None) -> None:
        torch.set_num_threads(1)
        large_allocations_to_the_system()  # before the model: freed tensors leave the process
        self.start = start or StartClock()  # the phases of this worker's start, told in its hello
        self.spec = spec_from_dict(spec)
        self.actor_id = actor_id
        self.cadence = CadenceMeter(self.spec.elastic.replicate_every)  # how often a step commits
        self.use_gpu = self.spec.elastic.use_gpu
        self.duties = NodeDuties(self.spec, actor_id, coordinator, namespace)
        self.duties.start_beating(store_host, heartbeat_port, store_secret)
        self.start.lap("beats")
        self.backend = "nccl" if self.use_gpu else "gloo"
        # float16 overflows are the loss scaler's to skip; elsewhere a non-finite loss is a bug
        self._finite_loss = self.spec.zero.compute_dtype != "float16"
        # a start failure is kept and told by hello(), as one line naming the field: raised here,
        # it would reach the coordinator as an actor death with a traceback
        self.start_error = ""
        try:
            self.device, self.held, self.source, self.batches, self.loss_fn, self.evaluator = \
                build_start_parts(self.spec, self.start, joiner)
        except Exception as exc:
            self.start_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return
        if joiner:  # the layout and hooks now, while the others train; the handover fills it (hollow until then)
            self.held.standalone_engine()
        # the layout before a handover stays until every rank has committed the new one, so that a
        # loss inside the handover is recovered from memory
        self.replicas = LayoutReplicas()
        self.pins = PinnedLayouts(release_pinned_cache)  # an old layout's cached pinned blocks given back
        self.replicator = Replicator()
        self._safe_point_for = -1  # the latest generation a safe point was requested for
        # the generation entered, its groups, whether it was aborted: an abort for g never reaches g + 1
        self._gate = GenerationGate()
        self.records = CheckpointRecords()
        self.notes = CoordinatorNotes(actor_id, coordinator, namespace)
        e = self.spec.elastic
        # the store and the coordinator's word, from whichever coordinator leads the job now
        self.link = CoordinatorLink(store_host, store_port, store_secret, e.collective_timeout_s, bool(coordinator),
                                    e.coordinator_wait_s, self.abort_generation, self.coordinator_lost, self.duties)
        self.store = self.link.store
        self.groups = GenerationGroups(self.store, self.spec.elastic.collective_timeout_s, self._gate,
                                       self.duties.collective_entered)
        c = self.spec.checkpoint
        # rank 0 commits; the coordinator hears of each commit as it happens
        told = self.notes.committed if self.notes else None
        # a job with no checkpoint.uri of its own writes its final weights to its run directory (job/prepare.py)
        self.writer = (AsyncCheckpointWriter(c.uri, self.store, c.keep, self.spec.zero.stage,
                                             self.spec.elastic.collective_timeout_s, on_commit=told)
                       if c.uri else None)
        # a checkpoint at the next step asked for in generation _checkpoint_for, taken unless a checkpoint
        # was saved for a request of that generation or a later one (_checkpoint_taken)
        self._checkpoint_for = self._checkpoint_taken = -1
        self.saves = CheckpointSaves(self.spec, self.writer, self.replicator, self.replicas, self.records)
        self.commits = StepCommits(self.spec, self.cadence, self.replicator, self.replicas, self.records, self.groups,
                                   self.device, self.notes.cadence if self.notes else None)
        self.summaries = SummaryReader(self.replicas, self.pins, self.commits, self.writer, self.store, self._finite_loss,
                                       self._gate.aborted.is_set)
        self.drills = DrillRunner(self.spec.faults, self.store, self.replicator, self.writer, self.duties, actor_id,
                                  coordinator, namespace)
        self.entry = GenerationEntry(self.spec, actor_id, self.held, self.store, self._gate, self.groups, self.commits,
                                     self.saves, self.drills, self.notes, self.replicas, self.backend)
        if coordinator:
            self.duties.take_sigterm_as_notice()
            relay_warnings(self.notes.warning)
        self.start.lap("setup")

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine of the moment (the entry into a generation may make it anew)."""
        return self.held.engine

    # ---- control, called concurrently with train() ----------------------------------------

    def hello(self) -> Hello:
        """Where this worker runs; raises WorkerStartError (one line) if it could not start."""
        if self.start_error:
            raise WorkerStartError(self.start_error)
        held = self.held
        return self.duties.hello(memory_facts(self.spec, held.model, held.wrap, held.optimizer, self.device), self.start)

    def watch_node(self, node: str) -> None:
        """Watch this node's cloud metadata server for the job (the coordinator picks one worker per node)."""
        self.duties.watch_node(node)

    def acknowledge_notice(self, ack: tuple) -> bool | str:
        return self.duties.acknowledge_notice(ack)

    def request_safe_point(self, number: int) -> None:
        """Stop at the next safe point of generation `number` (a request may arrive before train()
        starts it; one for an older generation, arriving late, is ignored)."""
        with self._gate.lock:
            self._safe_point_for = max(self._safe_point_for, number)

    def request_checkpoint(self, number: int) -> None:
        """Save a checkpoint at the next step of generation `number` (all ranks agree on the step
        through the step's closing all-reduce), then train on."""
        with self._gate.lock:
            self._checkpoint_for = max(self._checkpoint_for, number)

    def abort_generation(self, number: int) -> None:
        """A peer of generation `number` is gone: break our group now, so the training thread's
        next collective fails at once instead of when it reaches the dead peer or the timeout. It
        may come before train() entered that generation (kept for the entry) or after it left it
        (dropped): generation_gate.py."""
        self._gate.abort(number, self._interrupt_work)

    def coordinator_lost(self, taking_over: bool = False) -> None:
        """The coordinator is gone: the generation in progress stops at its next safe point, for a replacement
        to take over (coordinator_link.py); `taking_over` now: this worker no longer gives up on its own."""
        self.request_safe_point(self._gate.number)
        if taking_over:
            self.link.taking_over()

    def follow(self, store_host: str, store_port: int, secret: bytes, heartbeat_port: int | None) -> None:
        """A replacement coordinator took this worker over, its generation over: follow it."""
        self.link.follow(store_host, store_port, secret, heartbeat_port)

    def _interrupt_work(self) -> None:
        """The generation was aborted: the step in flight and a save waiting on a lost peer go."""
        if self.engine is not None:
            self.engine.interrupt()
        if self.writer is not None:  # a save waiting for the lost peer's part never commits
            self.writer.abandon()

    # ---- a generation ------------------------------------------------------------------------

    def train(self, plan: GenerationPlan) -> Report:
        # the report in the making; "uncommitted" (steps since the last commit) stays here
        report = {"generation": plan.number, "log": [], "uncommitted": [], "ward_log": [], "step_times": [],
                  "step_ends": [], "protect_times": [], "losses": [], "evals": [], "first_step_at": None,
                  "last_loss": None, "checkpoint_stall_s": [], "entered_at": time.time(), "checkpoint_errors": [],
                  "checkpoints": [], "checkpoints_skipped": [], "restored_from": None}
        self.link.watch_generation(plan.number)
        self.records.new_generation()  # the sample records this generation commits or saves
        self.cadence.new_generation()  # measured anew: the world size sets a shard's bytes
        self._previous = None  # the latest step's closing summary
        try:
            if self.device.type == "cuda":  # set_device holds per thread, and Ray may call on another
                torch.cuda.set_device(self.device)
            self.duties.mark(generation=plan.number, phase="entering")
            rank = self.entry.enter(plan, report)
            reset_peak()  # the peak its beats carry is this generation's steps', not its entry's
            self.duties.mark(steps=self.engine.step_count, phase="idle")
            if rank is None:
                return Report.made_from(report, Outcome(self.actor_id, OutcomeKind.LEFT, plan.step), time.time())
            report["rank"] = rank
            self.pins.entered(self.engine.partition.rank_numel(self.engine.rank))
            kind = self._loop(plan, rank, report)
            # finished: the replicas of the last step back a recovery should the final save lose a member
            replicas = self.replicas.report() if kind == OutcomeKind.FINISHED else {}
            outcome = Outcome(self.actor_id, kind, self.engine.step_count, **replicas)
            return Report.made_from(report, outcome, time.time())
        except Exception as exc:  # a collective failed (a peer died or timed out), or a bug
            ended = time.time()
            error = f"{type(exc).__name__}: {exc}"[:400]
            # the GPU failed, and its CUDA context with it: the process ends, recovered like a kill
            if is_device_failure(exc) and not self._gate.aborted.is_set():
                print(f"elastic_zero worker {self.actor_id}: device failure, exiting: {error}", flush=True)
                os._exit(1)
            bug = "" if is_communication_failure(exc, self._gate.aborted.is_set()) else error
            self.summaries.salvage(plan, report.get("rank", 0), plan.generation.world_size, self._previous, report)
            if self.writer is not None:
                self.writer.abandon()  # at once: a slow write must not make this survivor miss its deadline
                self.saves.take_news(report)
            abort_all(self._gate.groups)
            flight = self.replicator.settle()  # an exchange that completed before the failure still commits
            if flight is not None:
                self.commits.committed(plan, flight, report)
            if self.engine is not None:
                self.engine.discard_partial_step()
            step = self.engine.step_count if self.engine is not None else plan.step
            outcome = Outcome(self.actor_id, OutcomeKind.FAILED, step, error=error, bug=bug, **self.replicas.report())
            return Report.made_from(report, outcome, ended)
        finally:  # a batch made ahead is not held through the next generation's entry
            self.batches.forget()

    def _loop(self, plan: GenerationPlan, rank: int, report: dict) -> str:
        spec = self.spec
        world = plan.generation.world_size
        comm = self.groups.train_comm()
        engine = self.engine
        # the step before's closing summary, read during this step: what it asked for is done at this one
        previous, peak_reset = None, False
        while engine.step_count < spec.train.steps:
            step = engine.step_count
            for moment in ("step",) if report["step_times"] else ("first_step", "step"):
                self.drills.fire(moment, plan, rank, step)
            if report["first_step_at"] is None:  # ready to train: an evaluation first is not part of the stall
                report["first_step_at"] = time.time()
            self._evaluate_if_due(plan, rank, world, comm, report, step, previous)
            started = time.time()
            positions, weight, loss_sum, metric_sums, totals = self._forward_backward(world, rank, comm, step)
            # the next step's batches while the device runs this one's backward. No phase mark: a mark
            # restarts the collectives' count, and this rank, done with its backward, would look behind
            # a peer still in its own (plan/stuck.py)
            self.batches.prepare(step + 1, world, rank)
            if previous is not None:  # its all-reduce is long done: this read does not leave the device idle
                self.summaries.read(plan, rank, world, previous, report)
            waited = blocked = self.commits.finish(plan, report)  # the previous step's replicas, sent while this one ran
            self.drills.fire("commit", plan, rank, step)
            stop_asked, checkpoint_now = (previous.safe_point_asked, previous.checkpoint_asked) if previous else (False, False)
            if checkpoint_now:  # on every rank: a request still on its way to one is for this checkpoint too
                self._checkpoint_taken = max(self._checkpoint_for, plan.number)
            asked = self._safe_point_for == plan.number
            checkpoint_asked = self._checkpoint_for > self._checkpoint_taken  # asked in this generation or before
            save_due = bool(spec.checkpoint.every and (step + 1) % spec.checkpoint.every == 0)
            save_busy = bool(self.writer is not None and save_due and self.writer.busy())
            agree = step_summary(asked, weight, loss_sum, metric_sums, self.device, checkpoint_asked, save_busy=save_busy)
            # without replicas the layout is complete once every rank has taken its shards of it
            committed = self.replicas.generation == plan.number or not self.commits.replicating
            through = max(self.replicas.current.own, default=None) if self.replicas.generation == plan.number else None
            self.duties.mark(phase="agree")
            comm.all_reduce(agree)
            self._previous = summary = ClosingSummary.after_all_reduce(
                agree, step, sorted(metric_sums), committed, through, first=not report["step_times"], totals=totals)
            self.commits.agree_cadence(plan, rank, comm, report)
            report["uncommitted"].append((step, rank, positions.start, len(positions)))
            will_stop = stop_asked and step + 1 < spec.train.steps  # asked at the step before: stop after this one
            host_copy = self.commits.due(step + 1) or (will_stop and self.commits.replicating)
            if host_copy and committed:  # the older replicas (and layout) go before the step's copy is made,
                self.summaries.read(plan, rank, world, summary, report)  # not beside it: two at most, at rest one
            # a step that will commit (every `replicate_every`, or a safe point) has its host copy made in the update
            self.duties.mark(phase="update")
            stepped = engine.step(host_copy=host_copy)  # (False: fp16 gradients overflowed, the step skipped)
            engine.zero_grad()
            self.duties.mark(steps=engine.step_count, phase="commit")
            last = engine.step_count == spec.train.steps
            if save_due or checkpoint_now or last or will_stop:  # read before a save keeps a loss that is not finite
                self.summaries.read(plan, rank, world, summary, report)
            trained = time.time()
            copy_s = 0.0
            # a safe point always commits: the next generation's fallback is this layout at this step
            if (stepped and self.commits.due(engine.step_count)) or (will_stop and self.commits.replicating):
                copy_s = self.commits.start(plan, report, engine)
                blocked += copy_s
                if last or will_stop:  # nothing follows to hide the swap behind: committed before going on
                    self.commits.finish(plan, report)  # (its wait is in the time since `trained`)
            if last:  # the final weights are this step's checkpoint, written next
                self.drills.fire("final", plan, rank, engine.step_count)
            self.cadence.step_done(trained - started - waited - copy_s)  # its own time, less its commits'
            self.duties.mark(phase="save")
            self.saves.save(plan, report, engine, self.held.model, self.held.extra, now=checkpoint_now,
                            skip_periodic=save_due and summary.save_busy)
            self.duties.mark(phase="idle")
            report["step_ends"].append(time.time())
            report["step_times"].append(report["step_ends"][-1] - started)
            if not peak_reset and (summary.read or previous is not None) and not self.pins.release_due:
                reset_peak()  # the layout before is let go (read, its blocks given back): the peak its beats
                peak_reset = True  # carry is the steps' own from here (what the coordinator plans with)
            report["protect_times"].append(time.time() - trained + blocked)
            if rank == 0 and self.notes:
                self.notes.progress(plan.number, engine.step_count, last, report)
            if will_stop:  # its commit above kept the steps since the last one
                return OutcomeKind.SAFE_POINT
            previous = summary
        self._evaluate_if_due(plan, rank, world, comm, report, engine.step_count)  # the final weights
        if self.writer is not None:
            self.writer.wait()  # the final checkpoint is committed before the job reports success
            self.saves.take_news(report)
        return OutcomeKind.FINISHED

    def _evaluate_if_due(self, plan: GenerationPlan, rank: int, world: int, comm: TorchComm, report: dict,
                         step: int, before: ClosingSummary | None = None) -> None:
        """The weights after `step` steps on the eval set, when [eval] asks; rank 0 tells the coordinator.
        Lost inside it, the next generation restores that step (committed first) and evaluates it.
        `before`: the step before's summary, read first (a loss that is not finite fails the job first)."""
        if self.evaluator is None or not eval_due(step, self.spec.eval.every, self.spec.train.steps):
            return
        self.summaries.read(plan, rank, world, before, report)
        self.commits.finish(plan, report)
        self.drills.fire("eval", plan, rank, step)
        result = self.evaluator.evaluate(self.engine.module, comm, world, rank, step, self.device,
                                         lambda fn, batch: self._call_loss(batch, fn, "eval.loss"),
                                         finite=self._finite_loss)
        report["evals"].append(dataclasses.asdict(result))
        if rank == 0 and self.notes:
            self.notes.evaluated(plan.number, dataclasses.asdict(result))

    def _forward_backward(self, world: int, rank: int, comm: TorchComm,
                          step: int) -> tuple[range, float, torch.Tensor | float, dict, torch.Tensor | None]:
        """Forward and backward of this rank's share of the step (the update follows the step's
        closing all-reduce). Each micro batch's
        loss (a weighted mean, see losses.py) is scaled by its weight * world / the global weight, so
        that the engine's average over ranks is the weighted mean over the global batch. Returns this
        rank's (positions, weight, weight * loss, {metric: weight * value}) for the step's all-reduce
        (on the device), and the step's batch totals (losses.batch_totals, all-reduced; None: synthetic data)."""
        spec, engine = self.spec, self.engine
        self.duties.mark(phase="data")
        positions, micro, batches = self.batches.of_step(step, world, rank)
        self.duties.mark(phase="compute")
        weights = [batch_weight(b, len(m)) if m else 0.0 for b, m in zip(batches, micro)]
        global_weight, totals = float(spec.train.global_batch), None  # synthetic data: one per sample, known up front
        if self.source.num_samples is not None:  # a collate may weigh samples: the total is known only by asking,
            totals = batch_totals(weights, batches, self.device)  # on the device (a read would make the host wait
            comm.all_reduce(totals)  # for the step before): checked when the step's summary is read
            global_weight = totals[0]
        # the loss and metrics stay on the device until the step's all-reduce has summed them: a read
        # back here would make the host wait for each forward before it could queue the backward
        loss_sum, metric_sums = 0.0, None
        for i, (batch, weight) in enumerate(zip(batches, weights)):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            loss, value, metrics = checked(self._call_loss(batch), step, lazy=True)
            if metric_sums is not None and sorted(metrics) != sorted(metric_sums):
                raise ValueError(f"train.loss: returned metrics {sorted(metrics)} and {sorted(metric_sums)} in one "
                                 f"step: every call must return the same ones")
            metric_sums = metric_sums or dict.fromkeys(metrics, 0.0)
            scale = weight * world / global_weight  # a tensor (a weighed source's sum): in the loss's dtype, as a float
            engine.backward(loss * (scale.to(loss.dtype) if torch.is_tensor(scale) else scale), sync=i == len(micro) - 1)
            loss_sum += value * weight
            for name, v in metrics.items():
                metric_sums[name] += v * weight
        return positions, sum(weights), loss_sum, metric_sums or {}, totals

    def _call_loss(self, batch: dict, loss_fn=None, where: str = "train.loss"):
        self.duties.tick()  # a sign of life on the progress board, each micro batch and eval batch
        try:
            return (loss_fn or self.loss_fn)(self.engine.module, batch)
        except Exception as exc:
            # a lost peer shows here too (stage 3 gathers inside the forward), and a failing GPU: faults,
            # not the loss's bug
            if is_communication_failure(exc, self._gate.aborted.is_set()) or is_device_failure(exc):
                raise
            text = str(exc).splitlines()[0][:300] if str(exc) else ""
            raise ValueError(f"{where}: raised {type(exc).__name__}: {text}") from exc

    # ---- saves the coordinator asks for -------------------------------------------------------

    def settle_saves(self) -> dict:
        """Wait for the save in flight, if any: this rank's commits and errors since the last look."""
        return self.saves.settle()

    def checkpoint_now(self, plan: GenerationPlan, final: bool = False) -> dict:
        """Save the step `plan` reached and wait for the commit: when the job stops on request at a
        safe point, or (`final`) at the end of a job whose last step's checkpoint did not commit (a
        member was lost while it was written, and the job recovered from memory)."""
        if final:
            self.drills.fire("final", plan, plan.generation.rank_of(self.actor_id), self.engine.step_count)
        return self.saves.save_now(plan, self.engine, self.held.model, self.held.extra)

    # ---- the end -----------------------------------------------------------------------------

    def memory_report(self) -> dict:
        return self.held.memory_report()
