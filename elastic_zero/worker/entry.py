"""How a worker enters a generation, by where the generation's state comes from: a fresh start
(or a resume), the checkpoints (when memory holds no complete step), or a handover between the
participants (a planned change from the live state, or a recovery from replicas). One per worker,
owned by its Trainer (trainer.py), with the parts it enters through: the worker's model and engine,
its groups, commits, saves, drills and notes."""

from __future__ import annotations

import time

import torch

from elastic_zero.checkpoint import open_store, resolve, restore_candidates, restore_shard
from elastic_zero.plan.partition import partition_layout
from elastic_zero.plan.reshard import plan_reshard, received_from_others
from elastic_zero.protocol import GenerationPlan, Source
from elastic_zero.worker.handover import hand_over
from elastic_zero.zero import ShardState, ZeroEngine
from elastic_zero.zero.abortable import GroupAborted
from elastic_zero.zero.host_memory import building, host_empty


class _PhaseClock:
    """Seconds spent in each phase of entering a generation, written into `phases`."""

    def __init__(self, phases: dict) -> None:
        self.phases, self.t = phases, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.t, 4)
        self.t = now


def committed_key(plan: GenerationPlan) -> str:
    return f"g{plan.number}/committed"


def host_snapshot(engine: ZeroEngine) -> ShardState:
    """A host copy of `engine`'s shard, complete on return."""
    snapshot, copied = engine.host_shard_state()
    if copied is not None:
        copied.synchronize()
    return snapshot


class GenerationEntry:
    def __init__(self, spec, actor_id: str, held, store, gate, groups, commits, saves, drills, notes, replicas,
                 backend: str) -> None:
        """`held`: the worker's model and engine (worker_model.py); `gate`: its generation gate;
        `groups`, `commits`, `saves`, `drills`, `notes`: the worker's parts of those names;
        `replicas`: what it holds of its buddy's and its own snapshots; `backend`: its training
        group's ("nccl" or "gloo")."""
        self.spec, self.actor_id, self._held, self.store, self._gate = spec, actor_id, held, store, gate
        self.groups, self.commits, self.saves, self.drills, self.notes = groups, commits, saves, drills, notes
        self.replicas, self.backend = replicas, backend

    def enter(self, plan: GenerationPlan, report: dict) -> int | None:
        """Join generation `plan.number` (_enter_by_source) under the memory rule of each phase: the
        entry's restores, handovers and engines make and drop large transients, which go back to the
        system; the steps after it reuse their own memory (host_memory.py)."""
        with building():
            return self._enter_by_source(plan, report)

    def _enter_by_source(self, plan: GenerationPlan, report: dict) -> int | None:
        """Join generation `plan.number` in one of three ways, by where its state comes from; return
        this worker's rank, or None for a leaver that has handed its shards over."""
        clock = _PhaseClock(report.setdefault("phases_s", {}))
        self.saves.engine_released()  # a save of the engine's own tensors, abandoned or not
        self._gate.enter(plan.number, self.store, self._settle_work_left)
        self.commits.plan_keeps_replicas(plan.replicas)
        if plan.source in (Source.INIT, Source.RESTART):
            return self._start_fresh(plan, report, clock)
        if self._held.engine is None:
            self._held.standalone_engine()
        if plan.source == Source.CHECKPOINT:  # no complete step survived in memory
            return self._restore_checkpoint(plan, report, clock)
        return self._take_handover(plan, report, clock)  # "live" (a planned change) or "snapshot" (a recovery)

    def _settle_work_left(self, stale: bool) -> None:
        """Under the gate's lock, as a generation is entered: the engine forgets what it had in flight
        on the groups of an aborted generation (its gathers after the last step: every path that
        follows cuts its buffers anew from the shard), and any interrupt of the one left is over."""
        engine = self._held.engine
        if engine is not None:
            if stale:
                engine.forget_work_in_flight()
            engine.clear_interrupt()

    def _start_fresh(self, plan: GenerationPlan, report: dict, clock: _PhaseClock) -> int:
        """Generation 0, or a restart (nothing held a trained step): build the engine on its group,
        from the model as the job began or the checkpoint to resume."""
        rank = plan.generation.rank_of(self.actor_id)
        if plan.source == Source.RESTART:
            self._start_over()
            clock.lap("model")
        self.groups.build(plan, self._member_groups(plan, rank))
        self._held.new_engine(self.groups.train_comm())
        clock.lap("engine")
        if self.spec.checkpoint.resume:
            state, report["restored_from"] = self._restore(self._resume_candidates())
            if state is not None:  # "latest" with nothing committed yet: a fresh start
                report["received_bytes"] = state.nbytes()
                self._held.engine.load_shard_state(state)
        clock.lap("resume")
        self.commits.commit_now(plan, self._held.engine)
        clock.lap("commit")
        return rank

    def _start_over(self) -> None:
        """Let go of everything trained (the engine, its replicas) and build the model as the job
        began: the old engine and model go first, never two at once."""
        self.replicas.clear()
        self._held.start_over()

    def _restore_checkpoint(self, plan: GenerationPlan, report: dict, clock: _PhaseClock) -> int:
        """Every member reads its shard of the newest checkpoint all of them can read."""
        rank = plan.generation.rank_of(self.actor_id)
        self.groups.build(plan, self._member_groups(plan, rank))
        state, report["restored_from"] = self._restore(plan.checkpoints)
        report["received_bytes"] = state.nbytes()
        clock.lap("read_checkpoint")
        self._held.engine.reconfigure(self.groups.train_comm(), state)
        clock.lap("reconfigure")
        self.commits.commit_now(plan, self._held.engine)
        clock.lap("commit")
        return rank

    def _take_handover(self, plan: GenerationPlan, report: dict, clock: _PhaseClock) -> int | None:
        """The participants move the old layout's shards (live, or the replicas of a committed step)
        to the new layout by the reshard plan; leavers hand theirs over and wait for the commit."""
        world = plan.generation.world_size
        me = plan.participants.index(self.actor_id)
        # the participants are the new members in rank order, then the leavers; the members build
        # their training group (and, with leavers, a host group of their own) alongside the handover's
        wanted = {"handover": (me, len(plan.participants), "gloo")}
        if me < world:
            wanted.update(self._member_groups(plan, me, host=len(plan.participants) != world))
        self.groups.build(plan, wanted)  # an abort breaks the handover too
        clock.lap("groups")
        self.drills.fire("handover", plan, me if me < world else None, plan.step)  # participants: new ranks first
        old = partition_layout(self._held.engine.layout, plan.previous.world_size)
        new = partition_layout(self._held.engine.layout, world)
        template = ShardState(self._held.engine.layout, old, 0,
                              {n: torch.empty(0) for n in self._held.engine.vector_names()},
                              {**self._held.scalars(), "step": plan.step})
        store = self.replicas.of(plan.previous.number)
        if store is not None:  # the handover's step is the one restored, in this layout or a later one
            store.keep_only(plan.step)
        held = self._held_shards(plan)
        # what moves is held apart from the engine (replicas, or a host copy): its state goes before the
        # new shard comes (in a recovery it is stale anyway)
        self._held.engine.release_state()
        mine = hand_over(self.groups.handover_comm(), old, new, plan.holder_of_old,
                         list(range(world)), held, template)
        clock.lap("handover")
        if mine is None:
            self._await_new_layout(plan)
            return None
        moved = received_from_others(plan_reshard(old, new), plan.holder_of_old, list(range(world)), me)
        report["received_bytes"] = moved * sum(v.element_size() for v in mine.vectors.values())
        if self.commits.replicating:
            # the new layout is committed before the engine is cut anew, and the one before it goes as
            # soon as every member holds it: a worker never holds the old layout's replicas, the new
            # layout's and its engine's state at once
            self.commits.commit_now(plan, self._held.engine, snapshot=mine)  # `mine` is the snapshot as it is: reconfigure copies it
            self._layout_committed_everywhere(plan, me)
            clock.lap("commit")
        self._held.engine.reconfigure(self.groups.train_comm(), mine)
        clock.lap("reconfigure")
        return me

    def _layout_committed_everywhere(self, plan: GenerationPlan, rank: int) -> None:
        """After this member's commit: once every member's is done (a barrier on the host group), the
        layout before is needed no more, and the leavers may go."""
        self.groups.host_comm().all_reduce(host_empty(1, torch.float32).zero_())
        self.replicas.confirmed()
        if rank == 0 and plan.leaving:
            self.store.set(committed_key(plan), "1")

    def _await_new_layout(self, plan: GenerationPlan) -> None:
        """A leaver stays until every new rank has committed the new layout: until then its shard of
        the old one may be the last copy of that layout if a new member dies."""
        while not self.store.check([committed_key(plan)]):
            if self._gate.aborted.wait(0.01):
                raise GroupAborted("the generation failed before it committed its layout")

    def _resume_candidates(self) -> list[str]:
        """[checkpoint] resume: the checkpoint to start from, and for "latest" the earlier commits
        to fall back on, newest first ("latest" with none committed: start fresh)."""
        c = self.spec.checkpoint
        fs, root = open_store(c.uri)
        if c.resume != "latest":
            return [resolve(fs, root, c.resume)]
        return restore_candidates(fs, root)

    def _restore(self, candidates) -> tuple[ShardState | None, str | None]:
        """(this rank's shard, its checkpoint) from the first candidate every rank can read; (None,
        None) when there is no candidate (a fresh start)."""
        if not candidates:
            return None, None
        fs, _ = open_store(self.spec.checkpoint.uri)
        comm = self.groups.train_comm()
        state, directory = restore_shard(fs, candidates, self._held.engine.layout, comm.world_size, comm.rank,
                                         self._held.engine.vector_names(), comm, self._held.device)
        if comm.rank == 0 and self.notes:  # told as it happens: the job's events stay in their order
            self.notes.restored(self._gate.number, directory, int(state.scalars["step"]))
        return state, directory

    def _member_groups(self, plan: GenerationPlan, rank: int, host: bool = True) -> dict:
        """The groups a member of `plan` builds: its training group, and its host group unless the
        handover's serves (no leavers)."""
        world = plan.generation.world_size
        wanted = {"train": (rank, world, self.backend)}
        if host:
            wanted["host"] = (rank, world, "gloo")
        return wanted

    def _held_shards(self, plan: GenerationPlan) -> dict:
        """The old shards this process holds for the handover, by old rank."""
        prev = plan.previous
        mine = [r for r, holder in enumerate(plan.holder_of_old) if plan.participants[holder] == self.actor_id]
        if not mine:
            return {}
        replicas = self.replicas.of(prev.number)
        if plan.source == Source.LIVE:
            # the safe point committed this step: its own snapshot is the engine's state (no copy); a
            # host copy only without replicas
            kept = replicas.own.get(plan.step) if replicas is not None else None
            return {prev.rank_of(self.actor_id): kept if kept is not None else host_snapshot(self._held.engine)}
        own_rank = prev.rank_of(self.actor_id) if self.actor_id in [m.actor_id for m in prev.members] else None
        return {r: (replicas.own if r == own_rank else replicas.ward)[plan.step] for r in mine}
