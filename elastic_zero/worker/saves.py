"""How a worker saves checkpoints: its part of a step, written in the background (rank 0 commits),
when due, when asked, at a stop, and at the end (the final weights are the last step's checkpoint).
A mixin of Trainer (trainer.py), kept apart so the trainer module holds the step loop and its control."""

from __future__ import annotations

from elastic_zero.protocol import GenerationPlan


class CheckpointSaves:
    def _save_checkpoint(self, plan: GenerationPlan, report: dict, now: bool = False, again: bool = False,
                         waited: bool = False, skip_periodic: bool = False) -> None:
        """Save this rank's part of the step reached, if due: every `checkpoint.every` steps, the last
        step (the final weights), or `now` unless saved at this step already (`again`: even so).
        `waited`: the caller waits for the save before the engine changes again. `skip_periodic`: the
        ranks agreed that a save due by `every` would wait for the last one still being written (the
        step never waits for the store): it is skipped, its sample records going with the next."""
        step = self.engine.step_count
        every = self.spec.checkpoint.every
        due = (every and step % every == 0) or step == self.spec.train.steps or now
        if self.writer is None or not due:
            return
        if now and not again and self._saved_through == step - 1:  # saved at this step already
            return
        final = step == self.spec.train.steps or waited  # the weights the job ends with: nothing trains beside
        if skip_periodic and not (now or final):
            report["checkpoints_skipped"].append(step)
            return
        flight, copied = self.replicator.in_flight, None
        if flight is not None and flight.step == step:  # the snapshot on its way to the buddy
            snapshot, in_flight_rows, copied = flight.snapshot, flight.rows, flight.copied
        elif step in self.replicas.current.own:
            snapshot, in_flight_rows = self.replicas.current.own[step], []
        elif final:  # written from the engine's own tensors (a generation that follows, after a loss
            # in this save, waits for it first: _enter)
            snapshot, in_flight_rows = self.engine.shard_in_place(), []
            self._writer_reads_engine = True
        else:  # one copy off the device, on a side stream into pinned memory: the writer waits for it
            snapshot, copied = self.engine.host_shard_state()
            in_flight_rows = []
        extra = {"cursor": step * self.spec.train.global_batch, "seed": self.spec.train.seed,
                 "generation": plan.number, "optimizer": dict(vars(self.spec.optimizer)), **self._model_extra}
        # the checkpoint commits every step up to its own, replicated yet or not (checkpoint.every
        # need not be a multiple of replicate_every): their sample records go with it, and those of
        # every step this generation committed before, standing for its reports should every member
        # be lost (older checkpoints may be pruned by then); train() starts them anew each generation,
        # the coordinator holding the last generation's from its report
        rows = self._untold_log + [(plan.number, *row) for row in in_flight_rows + report["uncommitted"]]
        self._untold_log, self._saved_through = rows, step - 1  # rows name a step by its index
        # a save the caller waits for may follow one of the same step that did not commit: a tag of its own
        tag = f"g{plan.number}-s{step}" + ("-now" if waited else "")
        model_tensors = self._untrained_tensors() if final and self.engine.rank == 0 else None
        stall = self.writer.save(snapshot, tag, extra, rows, model_tensors, copied)
        if not final:  # what a step waited for the store (the final weights' save has no step beside it)
            report["checkpoint_stall_s"].append(stall)
        self._take_checkpoint_news(report)

    def _untrained_tensors(self) -> dict:
        """Host copies of what the model's state dict holds beyond the engine's shards: buffers
        (persistent ones) and parameters it does not train."""
        trained = {slot.name for slot in self.engine.layout.slots} | set(self._model_extra.get("aliases", {}))
        return {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()
                if name not in trained}

    def settle_saves(self) -> dict:
        """Wait for the save in flight, if any: this rank's commits and errors since the last look
        (rank 0 commits, so only its report names commits)."""
        report = {"checkpoint_errors": [], "checkpoints": []}
        if self.writer is not None:
            self.writer.wait()
            self._take_checkpoint_news(report)
        return report

    def checkpoint_now(self, plan: GenerationPlan, final: bool = False) -> dict:
        """Save the step `plan` reached (every rank; rank 0 commits) and wait for the commit, whether
        or not a save of it was made before (the coordinator asks when none of that step committed):
        when the job stops on request at a safe point, or (`final`) at the end of a job whose last
        step's checkpoint did not commit (a member was lost while it was written, and the job
        recovered from memory). Returns the commits and errors of this rank."""
        report = {"uncommitted": [], "checkpoint_stall_s": [], "checkpoint_errors": [], "checkpoints": []}
        if final:
            self._fire_drills("final", plan, plan.generation.rank_of(self.actor_id), self.engine.step_count)
        if self.writer is None:
            return report
        self._save_checkpoint(plan, report, now=True, again=True, waited=True)
        self.writer.wait()
        self._take_checkpoint_news(report)
        return report

    def _take_checkpoint_news(self, report: dict) -> None:
        """The commits and failures of background saves since the last look go into the report."""
        report["checkpoint_errors"].extend(self.writer.take_errors())
        report["checkpoints"].extend(self.writer.take_committed())
