"""The coordinator's decisions as a pure function: (state, event, now) -> (state, commands, reason).

No Ray, no clock reads: the coordinator's loop (job_loop.py) feeds events in and carries the commands out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

from elastic_zero.coordinator.events import (  # noqa: F401 - the events and commands are part of this module's API
    CheckpointCommitted, CheckpointNow, Event, Fail, FinalWeightsWritten, Finish, GenerationEnded, GenerationStepped,
    MemorySeen, PreemptionNotice, ReadyWorkersLost, RequestSafePoint, Retire, ScaleRequested, Spawn, Start,
    StartGeneration, Stop, StopRequested, Tick, Warn, WorkersReady, WorkerStartFailed,
)
from elastic_zero.coordinator.memory_rules import (
    StandbyShort, fitting_joiners, fitting_min, fitting_world, min_workers, standby_back_in_room, standby_beyond_room,
    why_more,
)
from elastic_zero.coordinator.recovery import Recovery, on_failure, try_recover
from elastic_zero.coordinator.safe_points import ask_for_safe_point_if_needed
from elastic_zero.coordinator.transitions import begin, fitted, remember, top_up
from elastic_zero.plan.membership import Generation, Member, next_generation
from elastic_zero.protocol import GenerationPlan, OutcomeKind, Source


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
    memory: object = None  # what the workers measured of memory (plan/memory.py MemoryView; None: nothing yet)
    # a checkpoint is there to fall back to: the job committed one (CheckpointCommitted) or resumed from one;
    # without it, a loss that memory cannot restore starts the job over from its initial weights
    committed: bool = False
    replicated: bool = True  # the workers keep buddy replicas in memory (elastic.replicate_every not 0)
    replicas_kept: bool = True  # the running generation's plan kept them (they fit its workers' memory)
    # workers kept started and ready beside the generation (elastic.standby_workers): a loss is made
    # good from them at once, not after a worker's start; a scale-up takes them too, and both are
    # topped back up
    standby: int = 0
    standby_short: StandbyShort = StandbyShort()  # those retired for room, to be asked for again (memory_rules.py)
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
    recovery: Recovery | None = None  # waiting for workers to reach min_workers
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

    @classmethod
    def at_start(cls, elastic, events: list[dict]) -> "CoordinatorState":
        """A coordinator's first state, for the job's `elastic` section; `events`: the job's log so
        far (a restarted coordinator numbers its generations on after its predecessor's)."""
        e, numbers = elastic, [r["generation"] for r in events if r.get("event") == "generation_start"]
        return cls(min_workers=e.min_workers, max_workers=e.max_workers, target=e.workers, min_wait_s=e.min_wait_s,
                   join_window_s=e.join_window_s, replicated=e.replicate_every != 0, standby=e.standby_workers,
                   first_generation=max(numbers) + 1 if numbers else 0)

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
        leaving = set(self.leaving)  # (a set: at 1,024 members, `in` a tuple of leavers made this quadratic)
        return tuple(a for a in self.members() if a not in leaving)

    def staying_count(self) -> int:
        """len(staying()), in O(1) while nobody leaves: the rules ask for it at every hello, and 64
        hellos at 1,024 members built 64 x 3 tuples of 1,024 (a fifth of the loop's GIL time then)."""
        if not self.leaving:
            return len(self.generation.members) if self.generation else 0
        return len(self.staying())


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
        count = state.target + state.standby
        return replace(state, spawning=count), (Spawn(count),), \
            f"start {state.target} workers" + (f" and {state.standby} on standby" if state.standby else "")
    if isinstance(event, WorkersReady):
        return _standby_in_room(*_on_ready(replace(state, start_losses=0), event.members, now))
    if isinstance(event, WorkerStartFailed):
        return _on_start_failure(state, event)
    if isinstance(event, ReadyWorkersLost):
        return _on_ready_lost(state, event, replace_them=True)
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
        return _on_generation_end(state, event.outcomes, now, event.coordinator_lost)
    if isinstance(event, FinalWeightsWritten):  # only ever sent while finishing
        return state, (), "FinalWeightsWritten ignored: no final save was running"
    if isinstance(event, CheckpointCommitted):
        return replace(state, committed=True), (), "a checkpoint was committed"
    if isinstance(event, MemorySeen):
        if event.killed:  # the generation is over: its recovery, not a standby's retirement, comes next
            return replace(state, memory=event.view), (), "memory taught by a kill"
        return _standby_in_room(replace(state, memory=event.view), (), "memory measured")
    if isinstance(event, GenerationStepped):
        if event.number != state.top_up_after:
            return state, (), f"generation {event.number} stepped"
        state, commands = top_up(replace(state, top_up_after=None))
        return state, commands, f"generation {event.number} stepped: replacements requested"
    if isinstance(event, Tick):
        if state.recovery is not None and now - state.waiting_since > state.min_wait_s:
            have = len([a for a in state.recovery.survivors if a not in state.leaving]) + len(state.ready)
            memory = why_more(state, have)
            below = f"below the {min_workers(state)} that memory needs ({memory})" if memory else \
                f"below min_workers {state.min_workers}"
            return (replace(state, done=True), (Fail(
                f"only {have} workers after a failure, {below}, for {state.min_wait_s:.0f} s"),),
                "gave up waiting for workers")
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
                       members_by_id=remember(state, event.members)), (), "ready workers kept while the final weights are written"
    if isinstance(event, WorkerStartFailed):
        return replace(state, spawning=max(0, state.spawning - 1)), (), f"worker {event.actor_id} failed to start"
    if isinstance(event, ReadyWorkersLost):  # kept as replacements: none is asked for now
        return _on_ready_lost(state, event, replace_them=False)
    if isinstance(event, Tick):
        return state, (), "nothing to do"
    if isinstance(event, CheckpointCommitted):
        return replace(state, committed=True), (), "a checkpoint was committed"
    if isinstance(event, MemorySeen):
        return replace(state, memory=event.view), (), "memory measured"
    return state, (), f"{type(event).__name__} ignored: training is over and the final weights are written"


def _on_ready(state, members, now):
    state = replace(state, ready=state.ready + tuple(members), spawning=max(0, state.spawning - len(members)),
                    members_by_id=remember(state, members))
    if state.generation is None:
        if len(state.ready) < state.target:
            return state, (), f"{len(state.ready)} of {state.target} workers ready"
        least = fitting_min(state)
        measured = state.memory is not None and state.memory.measured
        if least > state.max_workers and measured:  # not even max_workers hold the model's state
            return replace(state, done=True), (Fail(
                f"the model's state does not fit its workers' memory: {why_more(state, state.max_workers)} "
                f"(elastic.max_workers {state.max_workers})"),), "the state does not fit"
        if state.target < least <= state.max_workers:  # more workers, each holding less: the job waits for them
            state, spawn = top_up(replace(state, target=least))
            return state, spawn, f"{state.target} workers asked for, not {len(state.ready)}: {why_more(state, len(state.ready))}"
        world = fitting_world(state, [m.node for m in state.ready[: state.target]], max(state.min_workers, least))
        extra = ()
        if world < state.target:  # more workers on a node than fit beside each other: the others go
            extra = (Warn(f"{world} of {state.target} workers started: {state.memory.verdict(state.target, [m.node for m in state.ready[: state.target]], False).line(state.target)}"),
                     Retire(tuple(m.actor_id for m in state.ready[world:])))
            state = replace(state, target=world, ready=state.ready[:world])
        gen = replace(next_generation(None, state.ready[:world]), number=state.first_generation)
        plan, warn = fitted(state, GenerationPlan(gen, None, tuple(m.actor_id for m in gen.members), (), Source.INIT, 0, (),
                                                  "start"))
        return begin(state, plan, world), extra + warn + (StartGeneration(plan),), \
            f"generation {gen.number} with {gen.world_size} workers"
    if state.recovery is not None:
        return try_recover(state, now)
    return ask_for_safe_point_if_needed(state, "workers ready to join", now)


def _standby_in_room(state, commands, reason):
    """`decide`'s answer, less the standby workers the running generation's node has no room for, or
    with those retired for room asked for again where it has come back."""
    retire, line = standby_beyond_room(state)
    if not retire:
        back, line = standby_back_in_room(state)
        if not back:
            return state, commands, reason
        state, spawn = top_up(replace(state, standby=state.standby + back, standby_short=state.standby_short.asked_back(back)))
        return state, tuple(commands) + spawn, f"{reason}; {line}"
    held = max((state.memory.held or {}).get(a, 0) for a in retire)
    short = min(len(retire), state.standby)  # (a ready worker beyond the target and the standby is no standby's)
    state = replace(state, ready=tuple(m for m in state.ready if m.actor_id not in retire),
                    standby=state.standby - short, standby_short=state.standby_short.retired(short, held))
    line = f"{line}; the job goes on with {state.standby} standby worker(s), {state.standby_short.again()}"
    return state, tuple(commands) + (Warn(line), Retire(retire)), f"{reason}; {line}"


def _on_start_failure(state, event: WorkerStartFailed):
    """A worker that cannot start ends the job when the job has not started (its spec, its data or
    its machine is wrong for every worker alike) or when a replacement fails the same way twice. A
    worker lost while it started (its process or node died) is asked for again, up to
    MAX_START_LOSSES times in a row."""
    state = replace(state, spawning=max(0, state.spawning - 1))
    message = f"worker {event.actor_id} failed to start: {event.error}"
    have = state.staying_count() + len(state.ready) + state.spawning
    if state.generation is not None and state.standby and have >= state.target and not event.lost:
        # it was to stand by: the job trains on without it, and without standby workers from now on
        return replace(state, standby=max(0, have - state.target), standby_short=StandbyShort(),
                       errors_seen=state.errors_seen | {event.error}), \
            (Warn(f"{message}; the job goes on with {max(0, have - state.target)} standby worker(s)"),), \
            f"{message}: a standby worker; none asked for again"
    if event.lost:  # not the worker's own doing (a node lost under it): ask again, a few times in a row
        if state.start_losses < MAX_START_LOSSES:
            state, spawn = top_up(replace(state, start_losses=state.start_losses + 1))
            return state, spawn, f"{message} (its process or node was lost); another is asked for"
        if state.generation is not None:
            return state, (), f"{message}; {MAX_START_LOSSES + 1} starts in a row were lost: no replacement for now"
    if state.generation is None or event.error in state.errors_seen:
        return replace(state, done=True), (Fail(message, event.bad_input),), "a worker cannot start"
    state, spawn = top_up(replace(state, errors_seen=state.errors_seen | {event.error}))
    return state, spawn, f"{message}; another is asked for"


def _on_ready_lost(state, event: ReadyWorkersLost, replace_them: bool):
    """Ready workers (standing by, or waiting to join) whose process ended or whose node went silent:
    out of the ready ones, and others asked for in their place, before any plan counts on them."""
    lost = tuple(m.actor_id for m in state.ready if m.actor_id in event.actor_ids)
    if not lost:
        return state, (), f"{', '.join(event.actor_ids)} lost ({event.why}): not among the ready workers"
    ready = tuple(m for m in state.ready if m.actor_id not in lost)
    # (a joiner's wait for the ones still starting ends with the last ready one)
    state = replace(state, ready=ready, joiners_wait_since=state.joiners_wait_since if ready else None)
    if not replace_them:
        return state, (Retire(lost, lost=True),), f"{', '.join(lost)} lost while ready ({event.why}): retired"
    # one for one: each was asked for by a need that stands. Not top_up(): while a recovery waits, the
    # failed generation's dead members still count there, and replacements it put off until the
    # survivors step would be asked for now
    state = replace(state, spawning=state.spawning + len(lost))
    return state, (Retire(lost, lost=True), Spawn(len(lost))), \
        f"{', '.join(lost)} lost while ready ({event.why}): retired; {len(lost)} more asked for"


def _on_scale(state, workers, now):
    if not state.min_workers <= workers <= state.max_workers:
        return state, (), f"scale to {workers} refused: outside [{state.min_workers}, {state.max_workers}]"
    if workers < fitting_min(state):
        return state, (), f"scale to {workers} refused: {why_more(state, workers)}"
    state = replace(state, target=workers)
    commands = []
    staying = list(state.staying())
    if workers < len(staying):  # the highest ranks leave
        leavers = tuple(staying[workers:])
        state = replace(state, leaving=state.leaving + leavers)
    surplus = state.staying_count() + len(state.ready) - workers - state.standby  # the standby stay
    if surplus > 0 and state.ready:
        drop = state.ready[len(state.ready) - min(surplus, len(state.ready)) :]
        state = replace(state, ready=state.ready[: len(state.ready) - len(drop)])
        commands.append(Retire(tuple(m.actor_id for m in drop)))
    state, spawn = top_up(state)
    state, more, reason = ask_for_safe_point_if_needed(state, f"scale to {workers}", now)
    return state, tuple(commands) + spawn + more, reason


def _on_preemption(state, actor_ids, now):
    ready = tuple(m.actor_id for m in state.ready if m.actor_id in actor_ids)
    staying = set(state.staying())
    members = tuple(a for a in actor_ids if a in staying)
    others = [a for a in actor_ids if a not in ready + members]
    # ready to join, not yet in: they go now; members leave at a safe point; others are not ours to move
    state = replace(state, ready=tuple(m for m in state.ready if m.actor_id not in ready),
                    leaving=state.leaving + members)
    state, spawn = top_up(state)
    retire = (Retire(ready),) if ready else ()
    said = ([f"{', '.join(ready)} will be preempted before {'it' if len(ready) == 1 else 'they'} joined: retired"]
            if ready else []) + \
        ([f"not staying members: {', '.join(others)}"] if others else [])
    if not members:
        return state, retire + spawn, "preemption notice: " + "; ".join(said)
    state, more, reason = ask_for_safe_point_if_needed(state, f"{', '.join(members)} will be preempted", now)
    return state, retire + spawn + more, "; ".join([reason] + said)


def _on_generation_end(state, outcomes, now, coordinator_lost: bool = False):
    by_id = {o.actor_id: o for o in outcomes}
    members = state.members()
    kinds = [by_id[a].kind if a in by_id else OutcomeKind.DEAD for a in members]
    top_up_pending = state.top_up_after is not None  # its report raced the generation's end
    state = replace(state, running=False, safe_point_requested=False, top_up_after=None)
    if all(k == OutcomeKind.FINISHED for k in kinds):
        # workers told to leave (a notice or a scale-down the last step overtook) stay to the end: a
        # recovery in the final save must not plan a hand-off, which needs a step to commit its layout
        return replace(state, finishing=True, leaving=(), handover_leavers=()), (Finish(),), \
            "training finished: the final weights are written"
    dead = tuple(a for a, k in zip(members, kinds) if k == OutcomeKind.DEAD)
    failed = [by_id[a] for a, k in zip(members, kinds) if k == OutcomeKind.FAILED]
    # a leaver that dies inside the handover fails its peers' collectives; after it, nobody misses it
    dead_leavers = tuple(a for a in state.handover_leavers if a not in by_id) if failed else ()
    bugs = [o.bug for o in failed if o.bug]
    repeated = [b for b in bugs if b in state.errors_seen]
    if repeated:
        return replace(state, done=True), (Fail(f"the same error ended two generations: {repeated[0]}"),), \
            "a repeated error is a bug, not a fault"
    state = replace(state, errors_seen=state.errors_seen | set(bugs))
    if not (dead or dead_leavers) and failed and len(failed) == len(members) and not coordinator_lost:
        cause = bugs[0] if bugs else failed[0].error
        return replace(state, done=True), (Fail(f"every worker failed and none was lost: {cause}"),), \
            "failure without a lost worker"
    if dead or dead_leavers or failed:
        return on_failure(state, by_id, dead, dead_leavers, now)
    # every member reached the safe point: a planned change
    step = max(by_id[a].step for a in members)
    if state.stop_requested:
        everyone = members + tuple(m.actor_id for m in state.ready)
        return replace(state, done=True), (Stop(step, state.stop_checkpoint), Retire(everyone)), \
            f"stopped on request at step {step}"
    staying = [m for m in state.generation.members if m.actor_id not in state.leaving]
    joiners = fitting_joiners(state, staying, state.ready[: max(0, state.target - len(staying))])
    postponed = ()
    if len(staying) + len(joiners) < min_workers(state):  # a safe point asked for before the leave
        postponed, staying = state.leaving, list(state.generation.members)  # they leave once replaced
        joiners = fitting_joiners(state, staying, state.ready[: max(0, state.target - len(staying))])
    gen = next_generation(state.generation, staying + joiners)
    leavers = tuple(a for a in members if a in state.leaving and a not in postponed)
    participants = tuple(m.actor_id for m in gen.members) + leavers
    position = {a: i for i, a in enumerate(participants)}  # (a tuple's search per member: O(N^2))
    holder_of_old = tuple(position[a] for a in members)
    cause = "coordinator" if coordinator_lost else "scale" if not state.leaving else "leave"
    plan, warn = fitted(state, GenerationPlan(gen, state.generation, participants, holder_of_old, Source.LIVE, step, leavers,
                                              cause))
    state = begin(state, plan, len(joiners), leaving=postponed)
    state, spawn = top_up(state) if top_up_pending else (state, ())
    return state, warn + (StartGeneration(plan),) + spawn, \
        f"generation {gen.number}: {len(members)} -> {gen.world_size} workers at step {step}" + \
        (", from their memory after the coordinator's loss" if coordinator_lost else "")
