"""After a failure: where the next generation's state comes from, and when it may start. Part of
the coordinator's pure state machine (state.py).

The survivors go on from the latest step whose every shard memory holds (each rank's own snapshot
or its buddy's replica; inside a handover, the layout before it); else from the latest checkpoint;
else, nothing holding a trained step, from the job's initial weights, which loses nothing it would
not redo. The next generation starts once enough workers are there (min_workers, or more where
memory needs more: memory_rules.py); replacements are asked for after its first step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic_zero.coordinator.events import Retire, Spawn, StartGeneration
from elastic_zero.coordinator.memory_rules import fitting_joiners, min_workers, why_more
from elastic_zero.coordinator.transitions import begin, fitted
from elastic_zero.plan.membership import Generation, next_generation
from elastic_zero.plan.recovery import lost_ranks, restore_point
from elastic_zero.protocol import GenerationPlan, OutcomeKind, Source


@dataclass(frozen=True)
class Recovery:
    old: Generation
    survivors: tuple[str, ...]
    step: int
    holders: tuple[str, ...]  # actor per old rank; empty: from the latest checkpoint, or from the start
    source: Source  # SNAPSHOT (the holders' replicas), CHECKPOINT (the latest commit), RESTART (the start)
    why: str = ""  # for a restart: what was lost


def on_failure(state, by_id, dead, dead_leavers, now):
    """A member or a handover leaver was lost, or a collective failed: restore the latest step that
    memory holds for every rank, else the latest checkpoint, else start over."""
    gen = state.generation
    survivors = tuple(a for a in state.members() if a not in dead)
    point, old = restore_point(gen, survivors, *_holdings(by_id, gen.number)), gen
    # alive leavers of this generation's handover still hold their shards of the layout before it
    leavers = tuple(a for a in state.handover_leavers if a in by_id and by_id[a].kind == OutcomeKind.FAILED)
    if point is None and state.previous is not None:
        # lost before this generation's layout was committed on every rank: the layout it was
        # built from is still replicated in memory until then
        earlier = restore_point(state.previous, survivors + leavers, *_holdings(by_id, state.previous.number))
        if earlier is not None:
            point, old = earlier, state.previous
    survivors += leavers  # they leave as soon as no handover needs them
    state = replace(state, leaving=state.leaving + leavers)
    lost = dead + dead_leavers
    if point is not None:
        recovery = Recovery(old, survivors, *point, Source.SNAPSHOT)
    elif state.committed:
        recovery = Recovery(old, survivors, -1, (), Source.CHECKPOINT)
    else:  # nothing holds a trained step: the job starts over, which loses nothing it would not redo
        in_handover = any(by_id[a].snapshot_generation != gen.number for a in survivors)
        why = (f"a worker was lost before generation {gen.number} committed its layout, and neither that layout "
               f"nor the one before it is complete in memory" if in_handover else
               f"ranks {list(lost_ranks(gen, survivors))} and the replicas of their shards were lost together")
        if not state.replicated:
            why = f"ranks {list(lost_ranks(gen, survivors))} were lost and replication is off (elastic.replicate_every = 0)"
        elif not state.replicas_kept:
            why = (f"ranks {list(lost_ranks(gen, survivors))} were lost and generation {gen.number} kept no replicas "
                   f"(they did not fit its workers' memory)")
        recovery = Recovery(old, survivors, 0, (), Source.RESTART, f"{why}, and no checkpoint was committed")
    # (the standby, ready, join the recovery: what they leave missing is asked for after its first step)
    missing = state.target + state.standby - (len(survivors) - len(set(state.leaving) & set(survivors))
                                              + len(state.ready) + state.spawning)
    commands = [Retire(lost)] if lost else []
    staying = [a for a in survivors if a not in state.leaving]
    state = replace(state, recovery=recovery, waiting_since=now)
    go_on_now = len(staying) + len(state.ready) >= min_workers(state)
    if missing > 0 and not go_on_now:
        state = replace(state, spawning=state.spawning + missing)
        commands.append(Spawn(missing))
    state, more, reason = try_recover(state, now)
    if missing > 0 and go_on_now:
        state = replace(state, top_up_after=state.generation.number)
        reason += f"; {missing} replacement(s) after its first step"
    return state, tuple(commands) + more, f"lost {list(lost) or 'no worker'}; {reason}"


def _holdings(by_id, generation: int):
    """Per participant: the steps of its own snapshots and of its ward's replicas in `generation`'s ranks."""
    held = {a: o.replicas_of(generation) for a, o in by_id.items()}
    return {a: h[0] for a, h in held.items()}, {a: h[1] for a, h in held.items()}


def try_recover(state, now):
    rec = state.recovery
    staying = [state.members_by_id[a] for a in rec.survivors if a not in state.leaving]
    # as many as fit beside the survivors (on a node shared by several, more can fit worse)
    joiners = fitting_joiners(state, staying, state.ready[: max(0, state.target - len(staying))])
    world, least = len(staying) + len(joiners), min_workers(state)
    if world < least:
        memory = why_more(state, world)
        return state, (), (f"{world} workers, waiting for {least}: {memory}" if memory else
                           f"{world} workers, waiting for min_workers {state.min_workers}")
    # numbered after the failed generation, whose store keys stay taken, even when built from an earlier layout
    gen = replace(next_generation(rec.old, staying + joiners), number=state.generation.number + 1)
    new_ids = tuple(m.actor_id for m in gen.members)
    # a commit heard while it waited for workers is restored rather than starting over
    if rec.source == Source.CHECKPOINT or (rec.source == Source.RESTART and state.committed):
        # memory holds no complete step: every member reads the latest checkpoint
        plan = GenerationPlan(gen, rec.old, new_ids, (), Source.CHECKPOINT, -1, (), "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers restore the latest checkpoint"
    elif rec.source == Source.RESTART:
        plan = GenerationPlan(gen, rec.old, new_ids, (), Source.RESTART, 0, (), "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers start over from the initial weights: {rec.why}"
    else:
        members = set(new_ids)  # (sets and positions: at 1,024 workers a tuple's search per holder is 15-40 ms)
        holding_leavers = tuple(dict.fromkeys(h for h in rec.holders if h not in members))
        participants = new_ids + holding_leavers
        position = {a: i for i, a in enumerate(participants)}
        plan = GenerationPlan(gen, rec.old, participants, tuple(position[h] for h in rec.holders),
                              Source.SNAPSHOT, rec.step, holding_leavers, "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers restore step {rec.step}"
    plan, warn = fitted(state, plan)
    idle_leavers = tuple(a for a in rec.survivors if a in state.leaving and a not in plan.participants)
    retire = (Retire(idle_leavers),) if idle_leavers else ()
    return begin(state, plan, len(joiners)), retire + warn + (StartGeneration(plan),), reason
