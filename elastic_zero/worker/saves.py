"""How a worker saves checkpoints: its part of a step, written in the background (rank 0 commits),
when due, when asked, at a stop, and at the end (the final weights are the last step's checkpoint).
One per worker, owned by its Trainer (trainer.py), which hands it the engine and model of the moment."""

from __future__ import annotations

from elastic_zero.protocol import GenerationPlan


class CheckpointSaves:
    def __init__(self, spec, writer, replicator, replicas, records) -> None:
        """`writer`: the asynchronous checkpoint writer (None: the job saves none); `replicator` and
        `replicas`: where a snapshot of the step may already be; `records`: the sample records a
        checkpoint carries (checkpoint_records.py)."""
        self._spec, self._writer, self._replicator, self._replicas = spec, writer, replicator, replicas
        self._records = records
        self._reads_engine = False  # a save in flight writes from the engine's own tensors

    def save(self, plan: GenerationPlan, report: dict, engine, model, model_extra: dict, now: bool = False,
             again: bool = False, waited: bool = False, skip_periodic: bool = False) -> None:
        """Save this rank's part of the step `engine` reached, if due: every `checkpoint.every` steps,
        the last step (the final weights), or `now` unless saved at this step already (`again`: even
        so). `waited`: the caller waits for the save before the engine changes again. `skip_periodic`:
        the ranks agreed that a save due by `every` would wait for the last one still being written
        (the step never waits for the store): it is skipped, its sample records going with the next."""
        step = engine.step_count
        every = self._spec.checkpoint.every
        due = (every and step % every == 0) or step == self._spec.train.steps or now
        if self._writer is None or not due:
            return
        if now and not again and self._records.saved_at(step):  # saved at this step already
            return
        final = step == self._spec.train.steps or waited  # the weights the job ends with: nothing trains beside
        if skip_periodic and not (now or final):
            report["checkpoints_skipped"].append(step)
            return
        flight, copied = self._replicator.in_flight, None
        if flight is not None and flight.step == step:  # the snapshot on its way to the buddy
            snapshot, in_flight_rows, copied = flight.snapshot, flight.rows, flight.copied
        elif step in self._replicas.current.own:
            snapshot, in_flight_rows = self._replicas.current.own[step], []
        elif final:  # written from the engine's own tensors (a generation that follows, after a loss
            # in this save, waits for it first: engine_released())
            snapshot, in_flight_rows = engine.shard_in_place(), []
            self._reads_engine = True
        else:  # one copy off the device, on a side stream into pinned memory: the writer waits for it
            snapshot, copied = engine.host_shard_state()
            in_flight_rows = []
        extra = {"cursor": step * self._spec.train.global_batch, "seed": self._spec.train.seed,
                 "generation": plan.number, "optimizer": dict(vars(self._spec.optimizer)), **model_extra}
        # the checkpoint commits every step up to its own, replicated yet or not (checkpoint.every
        # need not be a multiple of replicate_every): their sample records go with it, and those of
        # every step this generation committed before
        rows = self._records.for_save(plan.number, in_flight_rows + report["uncommitted"], step)
        # a save the caller waits for may follow one of the same step that did not commit: a tag of its own
        tag = f"g{plan.number}-s{step}" + ("-now" if waited else "")
        model_tensors = _untrained_tensors(engine, model, model_extra) if final and engine.rank == 0 else None
        stall = self._writer.save(snapshot, tag, extra, rows, model_tensors, copied)
        if not final:  # what a step waited for the store (the final weights' save has no step beside it)
            report["checkpoint_stall_s"].append(stall)
        self.take_news(report)

    def engine_released(self) -> None:
        """Before the engine's tensors change hands (a generation is entered): a save that writes from
        them, abandoned or not, is waited for."""
        if self._reads_engine:
            self._writer.wait()
            self._reads_engine = False

    def settle(self) -> dict:
        """Wait for the save in flight, if any: this rank's commits and errors since the last look
        (rank 0 commits, so only its report names commits)."""
        report = {"checkpoint_errors": [], "checkpoints": []}
        if self._writer is not None:
            self._writer.wait()
            self.take_news(report)
        return report

    def save_now(self, plan: GenerationPlan, engine, model, model_extra: dict) -> dict:
        """Save the step `plan` reached (every rank; rank 0 commits) and wait for the commit, whether
        or not a save of it was made before (the coordinator asks when none of that step committed).
        Returns the commits and errors of this rank."""
        report = {"uncommitted": [], "checkpoint_stall_s": [], "checkpoint_errors": [], "checkpoints": []}
        if self._writer is None:
            return report
        self.save(plan, report, engine, model, model_extra, now=True, again=True, waited=True)
        self._writer.wait()
        self.take_news(report)
        return report

    def take_news(self, report: dict) -> None:
        """The commits and failures of background saves since the last look go into the report."""
        if self._writer is not None:
            report["checkpoint_errors"].extend(self._writer.take_errors())
            report["checkpoints"].extend(self._writer.take_committed())


def _untrained_tensors(engine, model, model_extra: dict) -> dict:
    """Host copies of what the model's state dict holds beyond the engine's shards: buffers
    (persistent ones) and parameters it does not train."""
    trained = {slot.name for slot in engine.layout.slots} | set(model_extra.get("aliases", {}))
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items() if name not in trained}
