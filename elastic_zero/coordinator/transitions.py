"""The moves of the coordinator's state that its rules share: part of its pure state machine
(state.py, recovery.py): a generation begins, workers are asked for up to the target, members are
remembered, a plan gets the replicas memory allows."""

from __future__ import annotations

from dataclasses import replace

from elastic_zero.coordinator.events import Spawn, Warn
from elastic_zero.coordinator.memory_rules import with_replicas
from elastic_zero.protocol import GenerationPlan


def begin(state, plan: GenerationPlan, joined: int, leaving: tuple[str, ...] = ()):
    """The state once `plan` starts: `joined` ready workers became members; `leaving` still to go."""
    return replace(state, generation=plan.generation, previous=plan.previous, handover_leavers=plan.leaving,
                   running=True, ready=state.ready[joined:], recovery=None, waiting_since=None, leaving=leaving,
                   joiners_wait_since=None, replicas_kept=plan.replicas)


def fitted(state, plan: GenerationPlan) -> tuple[GenerationPlan, tuple]:
    """`plan` with the replicas its workers have room for; a Warn command where they were dropped."""
    plan, dropped = with_replicas(state, plan)
    return plan, ((Warn(dropped),) if dropped else ())


def top_up(state):
    """Spawn workers up to the target (which never exceeds max_workers) and the standby beside it."""
    missing = state.target + state.standby - (state.staying_count() + len(state.ready) + state.spawning)
    if missing <= 0:
        return state, ()
    return replace(state, spawning=state.spawning + missing), (Spawn(missing),)


def remember(state, members) -> dict:
    known = dict(state.members_by_id)
    known.update({m.actor_id: m for m in members})
    return known


def taken_over(state, plan: GenerationPlan, target: int, stop: bool, stop_checkpoint: bool, committed: bool):
    """The state of a coordinator that took over the generation `plan` started, from a lost coordinator
    whose workers outlived it: its members and leavers known, numbering on after it, `target` the
    workers the job was to have, `stop` asked of it and not done (`stop_checkpoint`: with a checkpoint),
    `committed` whether a checkpoint is there to fall back to. Workers it had beside the generation
    (starting, ready, standing by) are not taken over: they are asked for again as it ends."""
    known = {m.actor_id: m for g in (plan.previous, plan.generation) if g is not None for m in g.members}
    state = replace(state, target=target, committed=committed, members_by_id=known, stop_requested=stop,
                    stop_checkpoint=stop_checkpoint, first_generation=max(state.first_generation, plan.number + 1))
    return replace(begin(state, plan, 0), top_up_after=plan.number)
