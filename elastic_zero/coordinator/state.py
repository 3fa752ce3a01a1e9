"""The coordinator's decisions as a pure function: (state, event, now) -> (state, commands, reason).

No Ray, no clock reads: the actor (actor.py) feeds events in and carries the commands out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

from elastic_zero.coordinator.events import (  # noqa: F401 - the events and commands are part of this module's API
    CheckpointCommitted, CheckpointNow, Event, Fail, FinalWeightsWritten, Finish, GenerationEnded, GenerationStepped, PreemptionNotice, RequestSafePoint,
    Retire, ScaleRequested, Spawn, Start, StartGeneration, Stop, StopRequested, Tick, WorkersReady, WorkerStartFailed,
)
from elastic_zero.coordinator.safe_points import ask_for_safe_point_if_needed
from elastic_zero.plan.membership import Generation, Member, next_generation
from elastic_zero.plan.recovery import lost_ranks, restore_point
from elastic_zero.protocol import GenerationPlan


@dataclass(frozen=True)
class _Recovery:
    old: Generation
    survivors: tuple[str, ...]
    step: int
    holders: tuple[str, ...]  # actor per old rank; empty: from the latest checkpoint, or from the start
    source: str  # "snapshot" (the holders' replicas), "checkpoint" (the latest commit), "restart" (the start)
    why: str = ""  # for a restart: what was lost


class Phase(Enum):
    STARTING = "starting"  # no generation yet: the first workers are starting
    RUNNING = "running"  # a generation trains (or hands over); its end is awaited
    WAITING = "waiting"  # a generation failed and the next waits for workers (below min_workers)
    DONE = "done"  # finished or failed: every event is ignored


class Decision(NamedTuple):
    """What decide() returns: the next state, the commands to carry out, and why."""

    state: "CoordinatorState"
    commands: tuple
    reason: str


MAX_START_LOSSES = 3


@dataclass(frozen=True)
class CoordinatorState:
    min_workers: int
    max_workers: int
    target: int
    min_wait_s: float = 60.0
    join_window_s: float = 5.0  # how long a ready joiner waits for workers still starting (a safe point each costs a stall)
    # a checkpoint is there to fall back to: the job committed one (CheckpointCommitted) or resumed from one;
    # without it, a loss that memory cannot restore starts the job over from its initial weights
    committed: bool = False
    replicated: bool = True  # the workers keep buddy replicas in memory (elastic.replicate_every > 0)
    first_generation: int = 0  # a restarted coordinator numbers on after its predecessor's generations
    generation: Generation | None = None
    previous: Generation | None = None  # the layout the running generation was built from
    handover_leavers: tuple[str, ...] = ()  # the running generation's leavers (they hand over, then exit)
    running: bool = False
    ready: tuple[Member, ...] = ()
    spawning: int = 0
    leaving: tuple[str, ...] = ()
    safe_point_requested: bool = False
    joiners_wait_since: float | None = None  # ready joiners wait for workers still starting, since then
    recovery: _Recovery | None = None  # waiting for workers to reach min_workers
    waiting_since: float | None = None
    # After a failure the survivors go on first and replacements are asked for once this
    # generation has stepped: a replacement warming up beside them would slow the recovery step.
    top_up_after: int | None = None
    # training finished and the final weights are being written: a member lost now is recovered
    # from the replicas of the last step (a GenerationEnded), like a loss during training
    finishing: bool = False
    done: bool = False
    members_by_id: dict = field(default_factory=dict)  # every member ever seen, by actor id
    # errors that were not faults (a worker's own exception; a worker that could not start): the
    # same one twice means a bug or a bad input, which replacing workers never mends
    errors_seen: frozenset = frozenset()
    start_losses: int = 0  # starting workers lost in a row (their process or node died, not their start)
    stop_requested: bool = False  # a graceful stop: the job ends at the next safe point
    stop_checkpoint: bool = False  # ... with a final checkpoint there
    # the generation whose members were asked for a checkpoint because its leavers cannot hand over
    checkpoint_asked_in: int | None = None

    @property
    def phase(self) -> "Phase":
        if self.done:
            return Phase.DONE
        if self.generation is None:
            return Phase.STARTING
        return Phase.RUNNING if self.running or self.finishing else Phase.WAITING

    def members(self) -> tuple[str, ...]:
        return tuple(m.actor_id for m in self.generation.members) if self.generation else ()

    def staying(self) -> tuple[str, ...]:
        return tuple(a for a in self.members() if a not in self.leaving)


def decide(state: CoordinatorState, event: Event, now: float) -> Decision:
    """The next state, the commands to carry out, and why."""
    state, commands, reason = _decide(state, event, now)
    if state.stop_requested and state.running and not state.safe_point_requested and not state.done:
        # a stop asked for while no generation ran (or before a recovery) is asked again of the next
        state, commands = replace(state, safe_point_requested=True), tuple(commands) + (RequestSafePoint(),)
    return Decision(state, tuple(commands), reason)


def _decide(state: CoordinatorState, event: Event, now: float):
    if state.phase is Phase.DONE:
        return state, (), "the job is over"
    if state.finishing:
        return _while_finishing(state, event, now)
    if isinstance(event, Start):
        return replace(state, spawning=state.target), (Spawn(state.target),), f"start {state.target} workers"
    if isinstance(event, WorkersReady):
        return _on_ready(replace(state, start_losses=0), event.members, now)
    if isinstance(event, WorkerStartFailed):
        return _on_start_failure(state, event)
    if isinstance(event, ScaleRequested):
        return _on_scale(state, event.workers, now)
    if isinstance(event, PreemptionNotice):
        return _on_preemption(state, event.actor_ids, now)
    if isinstance(event, StopRequested):
        if state.phase in (Phase.STARTING, Phase.WAITING):  # no safe point to wait for: stop now
            return (replace(state, done=True), (Stop(-1, False), Retire(state.members() + tuple(m.actor_id for m in state.ready))),
                    f"stopped on request while {state.phase.value}")
        state = replace(state, stop_requested=True, stop_checkpoint=state.stop_checkpoint or event.checkpoint)
        return state, (), "stop requested: the job ends at the next safe point"
    if isinstance(event, GenerationEnded):
        return _on_generation_end(state, event.outcomes, now)
    if isinstance(event, FinalWeightsWritten):  # only ever sent while finishing
        return state, (), "FinalWeightsWritten ignored: no final save was running"
    if isinstance(event, CheckpointCommitted):
        return replace(state, committed=True), (), "a checkpoint was committed"
    if isinstance(event, GenerationStepped):
        if event.number != state.top_up_after:
            return state, (), f"generation {event.number} stepped"
        state, commands = _top_up(replace(state, top_up_after=None))
        return state, commands, f"generation {event.number} stepped: replacements requested"
    if isinstance(event, Tick):
        if state.recovery is not None and now - state.waiting_since > state.min_wait_s:
            return (replace(state, done=True), (Fail(
                f"only {len(state.recovery.survivors)} workers after a failure, below min_workers "
                f"{state.min_workers}, for {state.min_wait_s:.0f} s"),), "gave up waiting for workers")
        if state.joiners_wait_since is not None:
            return ask_for_safe_point_if_needed(state, "workers ready to join", now)
        return state, (), "nothing to do"
    raise TypeError(f"unknown event {event!r}")


def _while_finishing(state, event, now):
    """Training is over; only the final save's end matters now."""
    if isinstance(event, FinalWeightsWritten):
        everyone = state.members() + tuple(m.actor_id for m in state.ready)
        return replace(state, done=True, finishing=False), (Retire(everyone),), "the final weights were written"
    if isinstance(event, GenerationEnded):  # members were lost in the final save
        state, commands, reason = _on_generation_end(replace(state, finishing=False, running=True), event.outcomes, now)
        return state, commands, f"lost while the final weights were written: {reason}"
    if isinstance(event, WorkersReady):  # kept: replacements, should the final save lose a member
        return replace(state, ready=state.ready + tuple(event.members), spawning=max(0, state.spawning - len(event.members)),
                       members_by_id=_remember(state, event.members)), (), "ready workers kept while the final weights are written"
    if isinstance(event, WorkerStartFailed):
        return replace(state, spawning=max(0, state.spawning - 1)), (), f"worker {event.actor_id} failed to start"
    if isinstance(event, Tick):
        return state, (), "nothing to do"
    if isinstance(event, CheckpointCommitted):
        return replace(state, committed=True), (), "a checkpoint was committed"
    return state, (), f"{type(event).__name__} ignored: training is over and the final weights are written"


def _remember(state: CoordinatorState, members) -> dict:
    known = dict(state.members_by_id)
    known.update({m.actor_id: m for m in members})
    return known


def _on_ready(state, members, now):
    state = replace(state, ready=state.ready + tuple(members), spawning=max(0, state.spawning - len(members)),
                    members_by_id=_remember(state, members))
    if state.generation is None:
        if len(state.ready) < state.target:
            return state, (), f"{len(state.ready)} of {state.target} workers ready"
        gen = replace(next_generation(None, state.ready[: state.target]), number=state.first_generation)
        plan = GenerationPlan(gen, None, tuple(m.actor_id for m in gen.members), (), "init", 0, (), "start")
        return _begin(state, plan, state.target), (StartGeneration(plan),), f"generation {gen.number} with {gen.world_size} workers"
    if state.recovery is not None:
        return _try_recover(state, now)
    return ask_for_safe_point_if_needed(state, "workers ready to join", now)


def _on_start_failure(state, event: WorkerStartFailed):
    """A worker that cannot start ends the job when the job has not started (its spec, its data or
    its machine is wrong for every worker alike) or when a replacement fails the same way twice. A
    worker lost while it started (its process or node died) is asked for again, up to
    MAX_START_LOSSES times in a row."""
    state = replace(state, spawning=max(0, state.spawning - 1))
    message = f"worker {event.actor_id} failed to start: {event.error}"
    if event.lost:  # not the worker's own doing (a node lost under it): ask again, a few times in a row
        if state.start_losses < MAX_START_LOSSES:
            state, spawn = _top_up(replace(state, start_losses=state.start_losses + 1))
            return state, spawn, f"{message} (its process or node was lost); another is asked for"
        if state.generation is not None:
            return state, (), f"{message}; {MAX_START_LOSSES + 1} starts in a row were lost: no replacement for now"
    if state.generation is None or event.error in state.errors_seen:
        return replace(state, done=True), (Fail(message),), "a worker cannot start"
    state, spawn = _top_up(replace(state, errors_seen=state.errors_seen | {event.error}))
    return state, spawn, f"{message}; another is asked for"


def _on_scale(state, workers, now):
    if not state.min_workers <= workers <= state.max_workers:
        return state, (), f"scale to {workers} refused: outside [{state.min_workers}, {state.max_workers}]"
    state = replace(state, target=workers)
    commands = []
    staying = list(state.staying())
    if workers < len(staying):  # the highest ranks leave
        leavers = tuple(staying[workers:])
        state = replace(state, leaving=state.leaving + leavers)
    surplus = len(state.staying()) + len(state.ready) - workers
    if surplus > 0 and state.ready:
        drop = state.ready[len(state.ready) - min(surplus, len(state.ready)) :]
        state = replace(state, ready=state.ready[: len(state.ready) - len(drop)])
        commands.append(Retire(tuple(m.actor_id for m in drop)))
    state, spawn = _top_up(state)
    state, more, reason = ask_for_safe_point_if_needed(state, f"scale to {workers}", now)
    return state, tuple(commands) + spawn + more, reason


def _on_preemption(state, actor_ids, now):
    ready = tuple(m.actor_id for m in state.ready if m.actor_id in actor_ids)
    members = tuple(a for a in actor_ids if a in state.staying())
    others = [a for a in actor_ids if a not in ready + members]
    # ready to join, not yet in: they go now; members leave at a safe point; others are not ours to move
    state = replace(state, ready=tuple(m for m in state.ready if m.actor_id not in ready),
                    leaving=state.leaving + members)
    state, spawn = _top_up(state)
    retire = (Retire(ready),) if ready else ()
    said = ([f"{', '.join(ready)} will be preempted before {'it' if len(ready) == 1 else 'they'} joined: retired"]
            if ready else []) + \
        ([f"not staying members: {', '.join(others)}"] if others else [])
    if not members:
        return state, retire + spawn, "preemption notice: " + "; ".join(said)
    state, more, reason = ask_for_safe_point_if_needed(state, f"{', '.join(members)} will be preempted", now)
    return state, retire + spawn + more, "; ".join([reason] + said)


def _top_up(state):
    """Spawn workers up to the target (which never exceeds max_workers)."""
    missing = state.target - (len(state.staying()) + len(state.ready) + state.spawning)
    if missing <= 0:
        return state, ()
    return replace(state, spawning=state.spawning + missing), (Spawn(missing),)


def _on_generation_end(state, outcomes, now):
    by_id = {o.actor_id: o for o in outcomes}
    members = state.members()
    kinds = [by_id[a].kind if a in by_id else "dead" for a in members]
    top_up_pending = state.top_up_after is not None  # its report raced the generation's end
    state = replace(state, running=False, safe_point_requested=False, top_up_after=None)
    if all(k == "finished" for k in kinds):
        # workers told to leave (a notice or a scale-down the last step overtook) stay to the end: a
        # recovery in the final save must not plan a hand-off, which needs a step to commit its layout
        return replace(state, finishing=True, leaving=(), handover_leavers=()), (Finish(),), \
            "training finished: the final weights are written"
    dead = tuple(a for a, k in zip(members, kinds) if k == "dead")
    failed = [by_id[a] for a, k in zip(members, kinds) if k == "failed"]
    # a leaver that dies inside the handover fails its peers' collectives; after it, nobody misses it
    dead_leavers = tuple(a for a in state.handover_leavers if a not in by_id) if failed else ()
    bugs = [o.bug for o in failed if o.bug]
    repeated = [b for b in bugs if b in state.errors_seen]
    if repeated:
        return replace(state, done=True), (Fail(f"the same error ended two generations: {repeated[0]}"),), \
            "a repeated error is a bug, not a fault"
    state = replace(state, errors_seen=state.errors_seen | set(bugs))
    if not (dead or dead_leavers) and failed and len(failed) == len(members):
        cause = bugs[0] if bugs else failed[0].error
        return replace(state, done=True), (Fail(f"every worker failed and none was lost: {cause}"),), \
            "failure without a lost worker"
    if dead or dead_leavers or failed:
        return _on_failure(state, by_id, dead, dead_leavers, now)
    # every member reached the safe point: a planned change
    step = max(by_id[a].step for a in members)
    if state.stop_requested:
        everyone = members + tuple(m.actor_id for m in state.ready)
        return replace(state, done=True), (Stop(step, state.stop_checkpoint), Retire(everyone)), \
            f"stopped on request at step {step}"
    staying = [m for m in state.generation.members if m.actor_id not in state.leaving]
    joiners = list(state.ready[: max(0, state.target - len(staying))])
    postponed = ()
    if len(staying) + len(joiners) < state.min_workers:  # a safe point asked for before the leave
        postponed, staying = state.leaving, list(state.generation.members)  # they leave once replaced
        joiners = list(state.ready[: max(0, state.target - len(staying))])
    gen = next_generation(state.generation, staying + joiners)
    leavers = tuple(a for a in members if a in state.leaving and a not in postponed)
    participants = tuple(m.actor_id for m in gen.members) + leavers
    holder_of_old = tuple(participants.index(a) for a in members)
    plan = GenerationPlan(gen, state.generation, participants, holder_of_old, "live", step, leavers,
                          "scale" if not state.leaving else "leave")
    state = _begin(state, plan, len(joiners), leaving=postponed)
    state, spawn = _top_up(state) if top_up_pending else (state, ())
    return state, (StartGeneration(plan),) + spawn, \
        f"generation {gen.number}: {len(members)} -> {gen.world_size} workers at step {step}"


def _on_failure(state, by_id, dead, dead_leavers, now):
    """A member or a handover leaver was lost, or a collective failed: restore the latest step that
    memory holds for every rank, else the latest checkpoint, else fail."""
    gen = state.generation
    survivors = tuple(a for a in state.members() if a not in dead)
    point, old = restore_point(gen, survivors, *_holdings(by_id, gen.number)), gen
    # alive leavers of this generation's handover still hold their shards of the layout before it
    leavers = tuple(a for a in state.handover_leavers if a in by_id and by_id[a].kind == "failed")
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
        recovery = _Recovery(old, survivors, *point, "snapshot")
    elif state.committed:
        recovery = _Recovery(old, survivors, -1, (), "checkpoint")
    else:  # nothing holds a trained step: the job starts over, which loses nothing it would not redo
        in_handover = any(by_id[a].snapshot_generation != gen.number for a in survivors)
        why = (f"a worker was lost before generation {gen.number} committed its layout, and neither that layout "
               f"nor the one before it is complete in memory" if in_handover else
               f"ranks {list(lost_ranks(gen, survivors))} and the replicas of their shards were lost together")
        if not state.replicated:
            why = f"ranks {list(lost_ranks(gen, survivors))} were lost and replication is off (elastic.replicate_every = 0)"
        recovery = _Recovery(old, survivors, 0, (), "restart", f"{why}, and no checkpoint was committed")
    missing = state.target - (len(survivors) - len(set(state.leaving) & set(survivors))
                              + len(state.ready) + state.spawning)
    commands = [Retire(lost)] if lost else []
    staying = [a for a in survivors if a not in state.leaving]
    go_on_now = len(staying) + len(state.ready) >= state.min_workers
    if missing > 0 and not go_on_now:
        state = replace(state, spawning=state.spawning + missing)
        commands.append(Spawn(missing))
    state = replace(state, recovery=recovery, waiting_since=now)
    state, more, reason = _try_recover(state, now)
    if missing > 0 and go_on_now:
        state = replace(state, top_up_after=state.generation.number)
        reason += f"; {missing} replacement(s) after its first step"
    return state, tuple(commands) + more, f"lost {list(lost) or 'no worker'}; {reason}"


def _holdings(by_id, generation: int):
    """Per participant: the steps of its own snapshots and of its ward's replicas in `generation`'s ranks."""
    held = {a: o.replicas_of(generation) for a, o in by_id.items()}
    return {a: h[0] for a, h in held.items()}, {a: h[1] for a, h in held.items()}


def _begin(state, plan: GenerationPlan, joined: int, leaving: tuple[str, ...] = ()):
    """The state once `plan` starts: `joined` ready workers became members; `leaving` still to go."""
    return replace(state, generation=plan.generation, previous=plan.previous, handover_leavers=plan.leaving,
                   running=True, ready=state.ready[joined:], recovery=None, waiting_since=None, leaving=leaving,
                   joiners_wait_since=None)


def _try_recover(state, now):
    rec = state.recovery
    staying = [state.members_by_id[a] for a in rec.survivors if a not in state.leaving]
    room = max(0, state.target - len(staying))
    joiners = list(state.ready[:room])
    if len(staying) + len(joiners) < state.min_workers:
        return state, (), f"{len(staying) + len(joiners)} workers, waiting for min_workers {state.min_workers}"
    # numbered after the failed generation, whose store keys stay taken, even when built from an earlier layout
    gen = replace(next_generation(rec.old, staying + joiners), number=state.generation.number + 1)
    new_ids = tuple(m.actor_id for m in gen.members)
    # a commit heard while it waited for workers is restored rather than starting over
    if rec.source == "checkpoint" or (rec.source == "restart" and state.committed):
        # memory holds no complete step: every member reads the latest checkpoint
        plan = GenerationPlan(gen, rec.old, new_ids, (), "checkpoint", -1, (), "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers restore the latest checkpoint"
    elif rec.source == "restart":
        plan = GenerationPlan(gen, rec.old, new_ids, (), "restart", 0, (), "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers start over from the initial weights: {rec.why}"
    else:
        holding_leavers = tuple(dict.fromkeys(h for h in rec.holders if h not in new_ids))
        participants = new_ids + holding_leavers
        plan = GenerationPlan(gen, rec.old, participants, tuple(participants.index(h) for h in rec.holders),
                              "snapshot", rec.step, holding_leavers, "failure")
        reason = f"generation {gen.number}: {gen.world_size} workers restore step {rec.step}"
    idle_leavers = tuple(a for a in rec.survivors if a in state.leaving and a not in plan.participants)
    retire = (Retire(idle_leavers),) if idle_leavers else ()
    return _begin(state, plan, len(joiners)), retire + (StartGeneration(plan),), reason
