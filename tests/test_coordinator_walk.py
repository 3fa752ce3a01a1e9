"""Random walks through the coordinator's state machine: whatever workers report, every plan it
starts is one the workers can carry out.

Each walk feeds `decide` a random mix of events a real job sees (workers ready, ready ones lost,
scale requests, preemption notices, memory measured (a standby that may crowd its node),
generations ending in safe points, finishes, failures and
deaths with any replicas reported, first steps, ticks) and checks every command against what the
walk knows: who was spawned, who was retired, which plan is running.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.coordinator.state import (
    CheckpointCommitted, CoordinatorState, Fail, Finish, GenerationEnded, GenerationStepped, MemorySeen,
    PreemptionNotice, ReadyWorkersLost, Retire, ScaleRequested, Spawn, Start, StartGeneration, Tick, WorkersReady,
    decide,
)
from elastic_zero.plan.membership import Member
from elastic_zero.plan.memory import GIB, MemoryView, ModelMemory, NodeRoom
from elastic_zero.protocol import Outcome


_MODEL = ModelMemory(unit_numels=(50 * 10**6,) * 2, stage=3, compute_bytes=4, state_vectors=2)  # 1.6 GB of state


class _World:
    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.standby_asked = state.standby
        self.spawned = 0
        self.pending_spawns = 0
        self.retired: set[str] = set()
        self.plan = None
        self.numbers: list[int] = []
        self.now = 0.0

    def apply(self, event) -> None:
        self.now += 1.0
        self.state, commands, reason = decide(self.state, event, self.now)
        assert isinstance(reason, str) and reason
        # standby workers retired for room and asked back never outnumber those the job asked for
        assert self.state.standby + self.state.standby_short.count <= self.standby_asked, reason
        for command in commands:
            self.check(command)

    def check(self, command) -> None:
        if isinstance(command, Spawn):
            assert command.count > 0
            self.pending_spawns += command.count
        elif isinstance(command, Retire):
            self.retired |= set(command.actor_ids)
            assert not {m.actor_id for m in self.state.ready} & set(command.actor_ids), "a retired worker kept ready"
        elif isinstance(command, StartGeneration):
            self.check_plan(command.plan)
        elif isinstance(command, (Finish, Fail)):
            self.plan = None

    def check_plan(self, plan) -> None:
        members = [m.actor_id for m in plan.generation.members]
        assert len(set(plan.participants)) == len(plan.participants)
        assert plan.participants[: len(members)] == tuple(members)  # new members by rank, then leavers
        assert set(plan.leaving) == set(plan.participants[len(members):])
        assert not set(plan.participants) & self.retired, "a retired worker was given a part"
        assert not self.numbers or plan.number > self.numbers[-1], "generation numbers must grow"
        assert len(members) >= self.state.min_workers and len(members) <= self.state.max_workers
        assert sorted(plan.generation.buddies) == list(range(len(members)))
        if plan.source in ("live", "snapshot"):
            assert len(plan.holder_of_old) == plan.previous.world_size
            assert all(0 <= h < len(plan.participants) for h in plan.holder_of_old)
            # every holder of an old shard was a member of the old layout or its buddy's host
            old_ids = [m.actor_id for m in plan.previous.members]
            assert all(plan.participants[h] in old_ids for h in plan.holder_of_old)
        else:
            assert plan.holder_of_old == ()
            assert plan.source != "checkpoint" or self.state.committed, "a checkpoint restore with nothing committed"
            assert plan.source != "restart" or (plan.step == 0 and not self.state.committed), "a restart past a commit"
        self.numbers.append(plan.number)
        self.plan = plan


def _outcomes(data, plan):
    """What the participants of `plan` report, drawn at random (one draw per participant)."""
    mode = data.draw(st.sampled_from(["safe_point", "safe_point", "failure", "failure", "finished"]))
    if mode != "failure":
        return tuple(Outcome(a, "left" if a in plan.leaving else mode, step=5,
                             own_steps=(5,), ward_steps=(5,), snapshot_generation=plan.number)
                     for a in plan.participants)
    dead = data.draw(st.sets(st.sampled_from(plan.participants), min_size=1,
                             max_size=max(1, len(plan.participants) // 2)))
    # which layout's replicas the survivors hold: the new one, the one before it (kept as
    # `earlier`, or never replaced), or a mix with some holding none
    layout = data.draw(st.sampled_from(["new", "earlier", "previous", "mixed"]))
    prev = plan.previous.number if plan.previous else -1
    outs = []
    for a in plan.participants:
        if a in dead:
            continue
        held = layout if layout != "mixed" else data.draw(st.sampled_from(["new", "earlier", "previous", "none"]))
        steps = data.draw(st.sampled_from([(4, 5), (4, 5), (5,), ()]))
        if held == "new":
            outs.append(Outcome(a, "failed", 5, steps, steps, snapshot_generation=plan.number))
        elif held == "earlier":
            outs.append(Outcome(a, "failed", 5, (5,), (), snapshot_generation=plan.number,
                                earlier=(prev, steps, steps)))
        elif held == "previous":
            outs.append(Outcome(a, "failed", 5, steps, steps, snapshot_generation=prev))
        else:
            outs.append(Outcome(a, "failed", 5))
    return tuple(outs)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 2), st.integers(2, 5), st.booleans())
def test_every_plan_from_a_random_walk_can_be_carried_out(data, min_workers, max_workers, checkpoints):
    target = data.draw(st.integers(min_workers, max_workers))
    world = _World(CoordinatorState(min_workers=min_workers, max_workers=max_workers, target=target,
                                    min_wait_s=5.0, standby=data.draw(st.integers(0, 1))))
    world.apply(Start())
    for _ in range(30):
        if world.state.done:
            break
        choices = ["scale", "tick", "memory"] + (["commit"] if checkpoints else [])
        if world.state.standby_short.count:  # a standby retired for room: room may come back
            choices += ["memory", "memory"]
        if world.pending_spawns:
            choices.append("ready")
        if world.plan is not None and world.state.running:
            choices += ["end", "end", "stepped", "preempt"]
        if world.state.ready:
            choices.append("ready_lost")
        event = data.draw(st.sampled_from(choices))
        if event == "ready":
            count = data.draw(st.integers(1, world.pending_spawns))
            world.pending_spawns -= count
            ids = [f"w{world.spawned + i}" for i in range(count)]
            world.spawned += count
            world.apply(WorkersReady(tuple(Member(i, node=f"n{int(i[1:]) % 2}") for i in ids)))
        elif event == "scale":
            world.apply(ScaleRequested(data.draw(st.integers(0, max_workers + 1))))
        elif event == "preempt":
            world.apply(PreemptionNotice(data.draw(st.sampled_from(world.plan.participants))))
        elif event == "ready_lost":  # a standby or a joiner whose process ended while it waited
            ready = [m.actor_id for m in world.state.ready]
            world.apply(ReadyWorkersLost(tuple(data.draw(st.sets(st.sampled_from(ready), min_size=1))), "silent"))
        elif event == "memory":  # measured: each node 3-64 GiB, each worker holding 0-2 GiB
            rooms = {f"n{i}": NodeRoom(data.draw(st.sampled_from([3, 5, 8, 64])) * GIB, 1.0) for i in range(2)}
            held = {f"w{i}": data.draw(st.sampled_from([0, GIB, 2 * GIB])) for i in range(world.spawned)}
            world.apply(MemorySeen(MemoryView(_MODEL, rooms, GIB // 2, measured=True, held=held)))
        elif event == "commit":
            world.apply(CheckpointCommitted())
        elif event == "stepped":
            world.apply(GenerationStepped(world.plan.number))
        elif event == "end":
            plan = world.plan
            world.plan = None
            world.apply(GenerationEnded(_outcomes(data, plan)))
        else:
            world.now += data.draw(st.sampled_from([0.0, 10.0]))
            world.apply(Tick())
