"""What memory allows the coordinator's plans: part of its pure state machine (state.py).

With what the workers measured (state.memory, a plan/memory.py MemoryView; None until the first
worker said hello), a plan never asks a worker for more than its node (and its GPU) has room for:
- a generation whose workers cannot hold the state even without replicas is not started: the
  fewest workers that can (`fitting_min`) act as min_workers (the job waits for replacements,
  min_wait_s, then fails with the numbers), and a scale below them is refused;
- a plan takes no more workers than fit (`fitting_world`): on a node shared by several, each one's
  interpreter and activations add up, so more workers can fit worse;
- replicas that do not fit beside the engine are dropped from the plan, with one line naming the
  numbers (keeping them would get workers killed: GPT-2 medium's shape on 2 workers of a 24 GB
  machine lost a worker to Ray's memory monitor twice in 3 steps).
- a standby worker stays only where its node has room for it beside the generation's workers, as
  measured (`standby_beyond_room`): the members and their replicas come first, and a standby on
  their node that would crowd them out is retired with one line of numbers, and asked for again
  once every node of theirs has room for it and a margin (`standby_back_in_room`), up to
  STANDBY_ROUNDS retirements.
Until a generation has stepped the figures are estimates (MemoryView.measured): the job is not
failed on an estimate alone, nor a standby retired.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic_zero.plan.memory import GIB

# a standby asked back is taken to hold this much more than the one retired held, so that a few MB
# of a node's others coming and going do not retire and ask for a worker over and over
STANDBY_MARGIN = 1.25
STANDBY_ROUNDS = 3  # retirements for room after which no standby is asked for again


@dataclass(frozen=True)
class StandbyShort:
    """The standby workers retired for room: how many are short of those the job asked for, in how
    many retirements, and the most one of them held (what one asked back is taken to need)."""

    count: int = 0
    rounds: int = 0
    held: int = 0

    def retired(self, count: int, held: int) -> "StandbyShort":
        return replace(self, count=self.count + count, rounds=self.rounds + 1, held=max(self.held, held)) if count else self

    def asked_back(self, count: int) -> "StandbyShort":
        return replace(self, count=self.count - count)

    def again(self) -> str:
        return ("asked for again when their node has room" if self.rounds < STANDBY_ROUNDS else
                f"none asked for again after {STANDBY_ROUNDS} retirements for room")


def _join_order(state) -> list[str]:
    """The nodes of the workers a plan would take, in the order it takes them: the staying members
    (during a recovery: the survivors), then the ready ones."""
    rec = state.recovery
    if rec is not None:
        staying = [state.members_by_id[a].node for a in rec.survivors if a not in state.leaving]
    else:
        members = {m.actor_id: m for m in state.generation.members} if state.generation else {}
        staying = [members[a].node for a in state.staying()]
    return staying + [m.node for m in state.ready]


def _placed(state, view, count: int) -> list[str]:
    """The nodes of `count` workers: those known (staying, then ready), then workers not started yet,
    each taken to land where a worker would have the most room (where Ray puts them is not known;
    a plan is checked again with their real nodes once they are ready)."""
    nodes = _join_order(state)[:count]
    on = {n: nodes.count(n) for n in view.rooms}
    while len(nodes) < count and on:
        best = max(sorted(on), key=lambda n: view.rooms[n].room // (on[n] + 1))
        on[best] += 1
        nodes.append(best)
    return nodes


def fitting_min(state) -> int:
    """The fewest workers whose state fits their nodes (without replicas): 1 while nothing is known;
    more than max_workers when not even that many fit."""
    view = state.memory
    if view is None or not view.rooms:
        return 1
    smallest = view.smallest_world(_placed(state, view, state.max_workers), state.max_workers)
    return smallest if smallest is not None else state.max_workers + 1


def min_workers(state) -> int:
    """min_workers, or more where memory needs more."""
    return max(state.min_workers, fitting_min(state))


def fitting_world(state, nodes: list[str], least: int) -> int:
    """How many of the workers on `nodes` (in the order a plan takes them) the plan may take: all of
    them, or the most from `least` on that fit; `least` when none does (the caller waits)."""
    view = state.memory
    if view is None or not view.rooms or len(nodes) <= least:
        return len(nodes)
    world = view.largest_world(nodes, least, len(nodes))
    return world if world is not None else least


def fitting_joiners(state, staying, joiners) -> list:
    """The ready workers (`joiners`, in the order they join) that join the members `staying`: as
    many as fit beside them."""
    nodes = [m.node for m in list(staying) + list(joiners)]
    return list(joiners[: max(0, fitting_world(state, nodes, len(staying)) - len(staying))])


def why_more(state, world: int) -> str:
    """Why `world` workers are too few for memory, in one line ('' when they are not)."""
    view = state.memory
    if view is None or world >= fitting_min(state) or world < 1:
        return ""
    return view.verdict(world, _placed(state, view, world), replicas=False).line(world)


def with_replicas(state, plan) -> tuple[object, str]:
    """`plan` with the replicas its workers have room for, and the line that says so where the job
    asked for them and they were dropped ('' otherwise)."""
    from dataclasses import replace

    if not state.replicated:
        return replace(plan, replicas=False), ""
    view = state.memory
    if view is None:
        return plan, ""
    verdict = view.verdict(plan.generation.world_size, [m.node for m in plan.generation.members], replicas=True)
    if verdict.replicas:
        return plan, ""
    return replace(plan, replicas=False), verdict.line(plan.generation.world_size)


def standby_beyond_room(state) -> tuple[tuple[str, ...], str]:
    """The standby workers (ready beyond the ones the target still takes in) whose node has no room
    for them beside the running generation's members, as measured, and the line that says so; none
    where the members do not fit even alone (the standby is not what crowds them: a memory kill
    teaches the plan). The last to stand by go first."""
    view, gen = state.memory, state.generation
    if view is None or not view.measured or gen is None or not state.running or state.recovery is not None:
        return (), ""
    standby = list(state.ready[max(0, state.target - state.staying_count()):])
    nodes = [m.node for m in gen.members]
    if not standby or not set(nodes) & {m.node for m in standby}:
        return (), ""
    kept = state.replicas_kept

    def verdict(outside):
        return view.verdict(gen.world_size, nodes, kept, view.held_on_nodes((m.actor_id, m.node) for m in outside))

    def fits(outside) -> bool:
        v = verdict(outside)
        return v.fits and v.replicas == kept

    worst = verdict(standby)
    if (worst.fits and worst.replicas == kept) or not fits(()):
        return (), ""
    on_theirs = [m for m in standby if m.node in nodes]
    retired = []
    while not fits([m for m in standby if m not in retired]):
        retired.append(on_theirs.pop())
    held = sum(view.held_on_nodes((m.actor_id, m.node) for m in retired).values())
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    ids = ", ".join(m.actor_id for m in retired)
    return tuple(m.actor_id for m in retired), (
        f"standby worker(s) {ids} retired: {gib(held)} held beside the generation's "
        f"{gen.world_size} worker(s), each of which needs {gib(worst.need_with_replicas if kept else worst.need)}"
        f"{' with replicas' if kept else ''}, left {gib(worst.room)} for each on node {worst.node[:12]}")


def standby_back_in_room(state) -> tuple[int, str]:
    """How many of the standby workers retired for room to ask for again, and the line that says so:
    as many as fit, each taken to hold STANDBY_MARGIN x what a retired one held, beside the running
    generation's members and its ready workers, on whichever node of the members' a new worker lands
    (Ray places it), as measured. None while workers are starting (what they will hold is not in the
    view yet) or the generation is short of its target (replacements wait for a recovered generation
    to step, or for starts that kept failing: a standby asked now would start them too), nor after
    STANDBY_ROUNDS retirements."""
    view, gen, short = state.memory, state.generation, state.standby_short
    if (not short.count or short.rounds >= STANDBY_ROUNDS or view is None or not view.measured
            or gen is None or not state.running or state.recovery is not None or state.spawning
            or state.staying_count() < state.target or state.top_up_after is not None or state.start_losses
            or state.stop_requested):
        return 0, ""
    nodes, kept = [m.node for m in gen.members], state.replicas_kept
    outside = view.held_on_nodes((m.actor_id, m.node) for m in state.ready)
    each = int(short.held * STANDBY_MARGIN)

    def fits_with(count: int, node: str) -> bool:
        v = view.verdict(gen.world_size, nodes, kept, {**outside, node: outside.get(node, 0) + count * each})
        return v.fits and v.replicas == kept

    for count in range(short.count, 0, -1):
        if all(fits_with(count, node) for node in set(nodes)):
            return count, (f"room again for {count} standby worker(s) of {short.held / GIB:.2f} GiB beside the "
                           f"generation's {gen.world_size} worker(s): asked for again")
    return 0, ""
