"""Memory foreseen (plan/memory.py, coordinator/memory_rules.py): what a worker will hold at any
world size, and the plans the coordinator makes with it. Pure. Oracles: the arithmetic of the
shards (the engine's own count is checked against it in test_engine_state.py), and the numbers
given to each plan."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.coordinator.state import (
    CoordinatorState, Fail, GenerationEnded, GenerationStepped, MemorySeen, Retire, ScaleRequested, Spawn, Start,
    StartGeneration, Tick, Warn, WorkersReady, decide,
)
from elastic_zero.plan.membership import Member
from elastic_zero.coordinator.memory_rules import StandbyShort
from elastic_zero.plan.memory import GIB, MemoryView, ModelMemory, NodeRoom
from elastic_zero.protocol import Outcome

pytestmark = pytest.mark.unit

M = 10**6
MODEL = ModelMemory(unit_numels=(25 * M,) * 4, stage=3, compute_bytes=4, state_vectors=2)  # 100M parameters


def test_what_a_worker_holds_shrinks_with_the_world_and_replicas_cost_four_snapshots():
    assert MODEL.engine_bytes(1) == 16 * 100 * M  # master, gradient and two AdamW vectors, fp32
    assert MODEL.engine_bytes(2) == 16 * 50 * M
    assert MODEL.snapshot_bytes(2) == 12 * 50 * M and MODEL.replica_bytes(2) == 4 * 12 * 50 * M
    bf16 = replace(MODEL, stage=2, compute_bytes=2)
    # the full parameters in bf16 beside an fp32 master, gradient and optimizer shards
    assert bf16.engine_bytes(2) == 100 * M * 2 + 16 * 50 * M
    assert replace(MODEL, stage=1).engine_bytes(2) == 100 * M * 4 * 2 + 12 * 50 * M  # the master a view
    assert MODEL.shard_numel(3) == 4 * -(-25 * M // 3)  # each unit padded to the world


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10**7), min_size=1, max_size=6), st.sampled_from([1, 2, 3]), st.sampled_from([2, 4]),
       st.integers(0, 2), st.integers(1, 64))
def test_a_worker_never_needs_more_at_a_larger_world(units, stage, compute, vectors, world):
    model = ModelMemory(tuple(units), stage, compute, vectors)
    for replicas in (False, True):  # up to a chunk's padding a unit more (a world's elements in a full buffer)
        assert model.state_bytes(world + 1, replicas) <= model.state_bytes(world, replicas) + len(units) * (world + 2) * 64
    view = MemoryView(model, {"n": NodeRoom(64 * GIB, 0.95)}, GIB)
    smallest = view.smallest_world(["n"] * 64, 64)
    if smallest is not None:  # the fewest that fit, and every one fewer does not
        assert view.verdict(smallest, ["n"] * smallest, False).fits
        assert all(not view.verdict(w, ["n"] * w, False).fits for w in range(1, smallest))


def _view(rooms, overhead=GIB):
    return MemoryView(MODEL, rooms, overhead)


def _ready(*ids, node="n0"):
    return WorkersReady(tuple(Member(i, node=node if isinstance(node, str) else node[k]) for k, i in enumerate(ids)))


def _cmd(commands, kind):
    return next((c for c in commands if isinstance(c, kind)), None)


def test_replicas_that_do_not_fit_are_dropped_with_one_line_of_numbers():
    """2 workers on a node of 8 GB (95%: 3.8 GB each): with replicas each would hold 4.27 GB (0.8 engine,
    2.4 replicas, 1 GiB beside), without 1.87 GB. The plan drops them and says so; a larger node keeps them."""
    s = CoordinatorState(min_workers=1, max_workers=4, target=2)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(_view({"n0": NodeRoom(8 * 10**9, 0.95)})), 0.0)
    s2, cmds, _ = decide(s, _ready("w0", "w1"), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    assert plan.replicas is False and plan.generation.world_size == 2
    warn = _cmd(cmds, Warn).message
    assert warn == ("replicas dropped at 2 worker(s): each would hold 3.98 GiB with them, 1.75 GiB without, and "
                    "node n0 has 3.54 GiB for each of its workers")
    assert cmds.index(_cmd(cmds, Warn)) < cmds.index(_cmd(cmds, StartGeneration))
    roomy, _, _ = decide(s, MemorySeen(_view({"n0": NodeRoom(16 * 10**9, 0.95)})), 0.0)
    _, cmds, _ = decide(roomy, _ready("w0", "w1"), 1.0)
    assert _cmd(cmds, StartGeneration).plan.replicas is True and _cmd(cmds, Warn) is None
    off = replace(roomy, replicated=False)  # replicate_every = 0: none, and nothing to say
    _, cmds, _ = decide(off, _ready("w0", "w1"), 1.0)
    assert _cmd(cmds, StartGeneration).plan.replicas is False and _cmd(cmds, Warn) is None


def _two_nodes_of(capacity):
    return {"n0": NodeRoom(capacity, 1.0), "n1": NodeRoom(capacity, 1.0)}


def test_a_generation_that_would_not_fit_is_not_started_and_the_job_waits_then_fails_with_the_numbers():
    """Two nodes of 3 GiB, one worker each; a worker beside its state holds 1.6 GiB: at 2 workers each
    holds 2.34 GiB, at 1 the whole model's 3.09 GiB. The survivor of a loss does not go on alone (seen
    before: one worker took the whole model's state, 18.3 GB on this machine, and a joiner started
    into the same death): the job waits for a replacement, and without one fails saying why."""
    view = _view(_two_nodes_of(3 * GIB), overhead=int(1.6 * GIB))
    s = CoordinatorState(min_workers=1, max_workers=2, target=2, min_wait_s=30.0)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(view), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", node=["n0", "n1"]), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    survivor = Outcome("w0", "failed", 5, (5,), (5,), snapshot_generation=plan.number)
    waiting, cmds, reason = decide(s, GenerationEnded((survivor,)), 10.0)
    assert _cmd(cmds, StartGeneration) is None and _cmd(cmds, Spawn) == Spawn(1)
    line = "at 1 worker(s) each would hold 3.09 GiB (without replicas), and node n0 has 3.00 GiB for each of its workers"
    assert reason.endswith(f"1 workers, waiting for 2: {line}")
    _, cmds, _ = decide(waiting, Tick(), 41.0)
    assert _cmd(cmds, Fail).message == f"only 1 workers after a failure, below the 2 that memory needs ({line}), for 30 s"
    _, cmds, _ = decide(waiting, _ready("w2", node="n1"), 12.0)  # a replacement: the two go on from memory
    plan = _cmd(cmds, StartGeneration).plan
    assert plan.source == "snapshot" and [m.actor_id for m in plan.generation.members] == ["w0", "w2"]
    # a scale to 1 is refused for the same reason; without memory known, only the bounds count
    _, cmds, reason = decide(s, ScaleRequested(1), 5.0)
    assert cmds == () and reason == f"scale to 1 refused: {line}"
    assert decide(replace(s, memory=None), ScaleRequested(1), 5.0)[2] != reason


def test_a_first_generation_that_would_not_fit_asks_for_more_workers_or_fails_at_once():
    view = _view(_two_nodes_of(3 * GIB), overhead=int(1.6 * GIB))
    s = CoordinatorState(min_workers=1, max_workers=2, target=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(view), 0.0)
    s, cmds, reason = decide(s, _ready("w0", node="n0"), 1.0)
    assert cmds == (Spawn(1),) and s.target == 2 and "2 workers asked for, not 1" in reason
    s, cmds, _ = decide(s, _ready("w1", node="n1"), 2.0)
    assert _cmd(cmds, StartGeneration).plan.generation.world_size == 2
    alone = CoordinatorState(min_workers=1, max_workers=1, target=1)
    alone, _, _ = decide(alone, Start(), 0.0)
    estimated, _, _ = decide(alone, MemorySeen(view), 0.0)
    # on an estimate (nothing has stepped yet) the job is not failed: it starts, and measures
    _, cmds, _ = decide(estimated, _ready("w0", node="n0"), 1.0)
    assert _cmd(cmds, StartGeneration) is not None and _cmd(cmds, Fail) is None
    known, _, _ = decide(alone, MemorySeen(replace(view, measured=True)), 0.0)
    _, cmds, _ = decide(known, _ready("w0", node="n0"), 1.0)
    assert _cmd(cmds, Fail).message.startswith("the model's state does not fit its workers' memory: at 1 worker(s)")


def test_a_plan_takes_no_more_workers_on_a_node_than_fit_beside_each_other():
    """Each worker's interpreter and activations add up on a shared node: 4 workers on one 8 GiB node
    need 2.07 GiB each against 2 GiB of room, 3 fit (2.2 GiB of 2.67). The first generation takes 3 and retires the
    fourth, saying so; a scale-up's joiners are taken as far as they fit."""
    view = MemoryView(MODEL, {"n0": NodeRoom(8 * GIB, 1.0)}, int(1.7 * GIB), measured=True)
    s = CoordinatorState(min_workers=1, max_workers=4, target=4)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(view), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", "w2", "w3"), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    assert plan.generation.world_size == 3 and _cmd(cmds, Retire).actor_ids == ("w3",) and s.target == 3
    assert _cmd(cmds, Warn).message.startswith("3 of 4 workers started: at 4 worker(s) each would hold 2.")


def test_a_recovery_counts_the_survivors_nodes_not_the_lost_ones():
    """The survivor is on a large node, the worker lost was on a small one, where the whole model's
    state would not fit: the recovery plans with the survivor's node (seen before: it waited for a
    second worker, blaming the small node where nobody was left)."""
    view = MemoryView(MODEL, {"big": NodeRoom(64 * GIB, 1.0), "small": NodeRoom(int(1.5 * GIB), 1.0)},
                      GIB // 2, measured=True)
    s = CoordinatorState(min_workers=1, max_workers=2, target=2, min_wait_s=30.0)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(view), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", node=["small", "big"]), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    assert plan.generation.world_size == 2
    survivor = Outcome("w1", "failed", 5, (5,), (5,), snapshot_generation=plan.number)
    _, cmds, reason = decide(s, GenerationEnded((survivor,)), 10.0)
    assert _cmd(cmds, StartGeneration).plan.generation.world_size == 1, reason


def test_on_a_gpu_the_engine_counts_against_the_device_and_the_node_holds_the_rest():
    """The engine's state lives on the GPU: a node of 3 GiB holds a worker's replicas and what is
    beside its state; a GPU of 1.5 GiB cannot hold the whole model's 1.6 GB with its units at work."""
    gpu = MemoryView(MODEL, {"n0": NodeRoom(3 * GIB, 1.0)}, GIB, device_room=int(1.5 * GIB), measured=True)
    # its own copies come off the device into pinned blocks, which torch's host allocator rounds up to
    # a power of two: 200 MB a vector takes 256 MiB; the ward's copies arrive in plain memory
    assert MODEL.snapshot_bytes(2, pinned=True) == 3 * 2**28 and MODEL.snapshot_bytes(2) == 3 * 200 * M
    assert gpu.need(1, False) == GIB and gpu.need(2, True) == GIB + 2 * 3 * 2**28 + 2 * 3 * 200 * M
    exact = ModelMemory(unit_numels=(2**26,), stage=3, compute_bytes=4, state_vectors=2)  # 256 MiB a vector
    assert exact.snapshot_bytes(1, pinned=True) == exact.snapshot_bytes(1) == 3 * 2**28
    alone = gpu.verdict(1, ["n0"], False)
    assert not alone.fits and alone.line(1) == "at 1 worker(s) each would hold 1.96 GiB on its GPU, which has 1.50 GiB"
    assert gpu.verdict(2, ["n0", "n0"], False).fits  # 1.3 GB each on the GPU, 1 GiB each of the node's 3


def test_a_node_whose_capacity_is_unknown_is_not_taken_for_an_empty_one():
    from elastic_zero.coordinator.memory_watch import MemoryWatch
    from elastic_zero.wire.heartbeats import Progress

    watch = MemoryWatch()
    watch.hello("w0", "n0", {"capacity": 0, "threshold": 0.95, "rss": GIB, "model": MODEL})  # not Linux, say
    watch.hello("w1", "n1", {"capacity": 8 * GIB, "threshold": 0.95, "rss": GIB, "model": MODEL})
    view = watch.view({"w1": Progress(0, 3, 9, GIB, GIB, 3 * GIB)})
    assert set(view.rooms) == {"n1"} and view.rooms["n1"].others == 2 * GIB and not view.measured
    assert view.verdict(1, ["n0"], False).fits  # no room known there: no refusal on a guess


def test_a_plan_whose_worker_was_killed_for_memory_is_not_made_again():
    """Ray's monitor killed a worker of a plan that was to fit: that shape counts on no more than the
    room its node had, so the recovery drops the replicas (the kill taught what the estimate missed)."""
    view = _view({"n0": NodeRoom(12 * 10**9, 0.95)})
    at_two = view.verdict(2, ["n0", "n0"], True)
    assert at_two.replicas and at_two.fits
    taught = view.killed(2, True, at_two.room)
    again = taught.verdict(2, ["n0", "n0"], True)
    assert again.fits and not again.replicas and again.need == view.need(2, False)


def _standing_by(room: int, held_by_standby: int, standby_node: str = "n0", measured: bool = True,
                 overhead_then: int = GIB):
    """A generation of w0 and w1 on node n0 (`room` bytes, all of it theirs), their replicas kept, and
    w2 on standby on `standby_node`; then a view in which w2 holds `held_by_standby` bytes and a
    worker `overhead_then` beside its state."""
    rooms = {"n0": NodeRoom(room, 1.0), "n1": NodeRoom(room, 1.0)}
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, standby=1)
    s, cmds, _ = decide(s, Start(), 0.0)
    assert cmds == (Spawn(3),)
    s, _, _ = decide(s, MemorySeen(replace(_view(rooms), measured=measured)), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", "w2", node=["n0", "n0", standby_node]), 1.0)
    assert _cmd(cmds, StartGeneration).plan.replicas and [m.actor_id for m in s.ready] == ["w2"]
    then = replace(_view(rooms, overhead_then), measured=measured, held={"w2": held_by_standby})
    return decide(s, MemorySeen(then), 2.0)


def test_a_standby_that_would_crowd_the_generation_out_of_its_node_is_retired_with_its_numbers():
    """Each of w0 and w1 needs 4.27 GB with replicas (0.8 engine, 2.4 replicas, 1 GiB beside): 10 GB
    holds both (5 GB each), but not beside a standby of 2 GB (4 GB each). The members come first: the
    standby goes, saying why (it is asked for again when room comes back: below)."""
    s, cmds, reason = _standing_by(10 * 10**9, 2 * 10**9)
    assert _cmd(cmds, Retire).actor_ids == ("w2",) and s.ready == () and s.standby == 0
    line = ("standby worker(s) w2 retired: 1.86 GiB held beside the generation's 2 worker(s), each of which "
            "needs 3.98 GiB with replicas, left 3.73 GiB for each on node n0; the job goes on with 0 standby "
            "worker(s), asked for again when their node has room")
    assert _cmd(cmds, Warn).message == line and reason.endswith(line)
    assert _cmd(cmds, StartGeneration) is None and _cmd(cmds, Spawn) is None
    # a smaller standby fits beside them (5 - 0.5 / 2 = 4.75 GB each), as does one on another node
    for kept, _, _ in (_standing_by(10 * 10**9, 10**9 // 2), _standing_by(10 * 10**9, 2 * 10**9, standby_node="n1")):
        assert [m.actor_id for m in kept.ready] == ["w2"] and kept.standby == 1
    # on an estimate (nothing stepped yet) nothing is retired; nor where the members do not fit even
    # alone (3 GiB beside the state measured: 6.4 GB each of 5): the standby is not what crowds them
    for kept, cmds, _ in (_standing_by(10 * 10**9, 2 * 10**9, measured=False),
                          _standing_by(10 * 10**9, 2 * 10**9, overhead_then=3 * GIB)):
        assert kept.standby == 1 and _cmd(cmds, Retire) is None


def _room_again(capacity: int, measured: bool = True):
    """The retired standby's state (see above), then a view in which node n0 has `capacity` bytes (10 GB
    when w2 was retired), and its decision."""
    s, _, _ = _standing_by(10 * 10**9, 2 * 10**9)
    assert s.standby == 0 and s.standby_short == StandbyShort(count=1, rounds=1, held=2 * 10**9)
    rooms = {"n0": NodeRoom(capacity, 1.0), "n1": NodeRoom(10 * 10**9, 1.0)}
    return decide(s, MemorySeen(replace(_view(rooms), measured=measured)), 3.0)


def test_a_standby_retired_for_room_is_asked_for_again_once_its_node_has_room_and_a_margin():
    """w2 (2 GB) was retired beside members of 4.27 GB each on 10 GB. At 14 GB (the node's others gone,
    say) one of 2.5 GB (the margin: 1.25x) fits beside them: one is asked for, and it stays when it
    comes. At 11 GB, 2 GB would fit (4.5 GB each) but not with the margin (4.25): nobody is asked for,
    so that a few MB coming and going do not retire and ask for workers over and over."""
    s, cmds, reason = _room_again(14 * 10**9)
    assert _cmd(cmds, Spawn) == Spawn(1) and (s.standby, s.standby_short.count, s.spawning) == (1, 0, 1)
    assert reason.endswith("room again for 1 standby worker(s) of 1.86 GiB beside the generation's 2 worker(s): "
                           "asked for again")
    rooms = {"n0": NodeRoom(14 * 10**9, 1.0), "n1": NodeRoom(10 * 10**9, 1.0)}
    s, cmds, _ = decide(s, _ready("w3"), 4.0)
    s, cmds, _ = decide(s, MemorySeen(replace(_view(rooms), measured=True, held={"w3": 2 * 10**9})), 5.0)
    assert _cmd(cmds, Retire) is None and [m.actor_id for m in s.ready] == ["w3"] and s.standby == 1
    for still_tight in (_room_again(11 * 10**9), _room_again(14 * 10**9, measured=False)):  # nor on an estimate
        assert _cmd(still_tight[1], Spawn) is None and still_tight[0].standby_short.count == 1
    # two short, room for one: one is asked for, and no more while it starts (what it will hold is not
    # in the view yet: the same view would ask for the second too)
    s, _, _ = _standing_by(10 * 10**9, 2 * 10**9)
    view = replace(_view({"n0": NodeRoom(int(12.5 * 10**9), 1.0)}), measured=True)
    s, cmds, _ = decide(replace(s, standby_short=replace(s.standby_short, count=2)), MemorySeen(view), 3.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and s.standby_short.count == 1
    s, cmds, _ = decide(s, MemorySeen(replace(view, overhead=GIB + 1)), 3.5)
    assert _cmd(cmds, Spawn) is None and s.standby == 1


def test_a_standby_is_asked_back_only_where_every_node_of_the_members_has_room():
    """Ray places a new worker: one asked back must fit on whichever node of the generation's it lands.
    With a member on n0 (room again) and one on n1 (still tight), nobody is asked for."""
    rooms = {"n0": NodeRoom(14 * 10**9, 1.0), "n1": NodeRoom(5 * 10**9, 1.0)}
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, standby=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(replace(_view(rooms), measured=True)), 0.0)
    s, _, _ = decide(s, _ready("w0", "w1", "w2", node=["n0", "n1", "n0"]), 1.0)
    tight = {"n0": NodeRoom(5 * 10**9, 1.0), "n1": NodeRoom(5 * 10**9, 1.0)}
    s, cmds, _ = decide(s, MemorySeen(replace(_view(tight), measured=True, held={"w2": 2 * 10**9})), 2.0)
    assert _cmd(cmds, Retire).actor_ids == ("w2",) and s.standby_short.count == 1
    s, cmds, _ = decide(s, MemorySeen(replace(_view(rooms), measured=True)), 3.0)
    assert _cmd(cmds, Spawn) is None and s.standby_short.count == 1
    roomy = {"n0": NodeRoom(14 * 10**9, 1.0), "n1": NodeRoom(14 * 10**9, 1.0)}
    s, cmds, _ = decide(s, MemorySeen(replace(_view(roomy), measured=True)), 4.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and s.standby == 1


def test_no_standby_is_asked_back_while_a_recovered_generation_waits_to_step():
    """A member lost after the standby was retired: the survivor goes on alone, and its replacement is
    asked for once that generation has stepped (a worker starting beside it would slow the recovery
    step). The room the loss leaves asks no standby back before then: it would start the replacement
    too. After the step, the replacement; the standby once it is in."""
    s, _, _ = _standing_by(10 * 10**9, 2 * 10**9)
    plan = s.generation
    survivor = Outcome("w0", "failed", 5, (4, 5), (4, 5), snapshot_generation=plan.number)
    s, cmds, _ = decide(s, GenerationEnded((survivor,)), 3.0)
    recovered = _cmd(cmds, StartGeneration).plan
    assert recovered.generation.world_size == 1 and _cmd(cmds, Spawn) is None and s.top_up_after == recovered.number
    roomy = replace(_view({"n0": NodeRoom(14 * 10**9, 1.0)}), measured=True)
    s, cmds, _ = decide(s, MemorySeen(roomy), 4.0)
    assert _cmd(cmds, Spawn) is None and s.standby_short.count == 1
    s, cmds, _ = decide(s, GenerationStepped(recovered.number), 5.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and s.standby == 0  # the replacement alone
    s, _, _ = decide(s, _ready("w3"), 6.0)
    s, cmds, _ = decide(s, MemorySeen(replace(roomy, overhead=GIB + 1)), 7.0)  # w3 joins at the next safe point
    assert _cmd(cmds, Spawn) is None
    s, cmds, _ = decide(s, GenerationEnded(tuple(Outcome(a, "ok", 7, (6, 7), (6, 7)) for a in ("w0",))), 8.0)
    assert [m.actor_id for m in _cmd(cmds, StartGeneration).plan.generation.members] == ["w0", "w3"]
    s, cmds, _ = decide(s, MemorySeen(replace(roomy, overhead=GIB + 2)), 9.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and s.standby == 1


def test_after_three_retirements_for_room_no_standby_is_asked_for_again():
    """A node whose room comes and goes: the standby is retired and asked back, up to three retirements;
    the third says that none is asked for again, and none is."""
    tight = {"n0": NodeRoom(10 * 10**9, 1.0), "n1": NodeRoom(10 * 10**9, 1.0)}
    roomy = {"n0": NodeRoom(14 * 10**9, 1.0), "n1": NodeRoom(10 * 10**9, 1.0)}
    s, cmds, _ = _standing_by(10 * 10**9, 2 * 10**9)
    for round_ in (2, 3):
        s, cmds, _ = decide(s, MemorySeen(replace(_view(roomy), measured=True)), round_ * 10.0)
        assert _cmd(cmds, Spawn) == Spawn(1)
        joiner = f"w{round_ + 1}"
        s, _, _ = decide(s, _ready(joiner), round_ * 10.0 + 1)
        s, cmds, _ = decide(s, MemorySeen(replace(_view(tight), measured=True, held={joiner: 2 * 10**9})), round_ * 10.0 + 2)
        assert _cmd(cmds, Retire).actor_ids == (joiner,) and s.standby_short.rounds == round_
    assert _cmd(cmds, Warn).message.endswith("the job goes on with 0 standby worker(s), none asked for again after "
                                             "3 retirements for room")
    s, cmds, _ = decide(s, MemorySeen(replace(_view(roomy), measured=True)), 40.0)
    assert _cmd(cmds, Spawn) is None and s.standby == 0



def test_a_standby_asked_back_that_cannot_start_is_not_asked_for_again():
    """Asked back, it fails to start (its own error, not a lost node): as for any standby that cannot
    start, the job trains on without standby workers, and room coming back asks for none."""
    from elastic_zero.coordinator.state import WorkerStartFailed

    s, _, _ = _standing_by(10 * 10**9, 2 * 10**9)
    room_for_one = replace(_view({"n0": NodeRoom(int(12.5 * 10**9), 1.0)}), measured=True)
    s, cmds, _ = decide(replace(s, standby_short=replace(s.standby_short, count=2)), MemorySeen(room_for_one), 3.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and s.standby_short.count == 1
    s, cmds, _ = decide(s, WorkerStartFailed("w3", "ImportError: no module named 'x'"), 4.0)
    roomy = replace(_view({"n0": NodeRoom(20 * 10**9, 1.0)}), measured=True)
    s, cmds, _ = decide(s, MemorySeen(roomy), 5.0)
    assert _cmd(cmds, Spawn) is None and s.standby == 0 and s.standby_short.count == 0


def test_a_standby_ready_after_the_generation_began_is_weighed_as_it_comes():
    """The standby's hello comes in after the generation started, with the view already holding its
    beats: the same rule, at its WorkersReady."""
    rooms = {"n0": NodeRoom(10 * 10**9, 1.0)}
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, standby=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(replace(_view(rooms), measured=True, held={"w2": 2 * 10**9})), 0.0)
    s, _, _ = decide(s, _ready("w0", "w1"), 1.0)
    s, cmds, _ = decide(s, _ready("w2"), 2.0)
    assert _cmd(cmds, Retire).actor_ids == ("w2",) and s.standby == 0


def test_the_memory_watch_counts_a_standbys_beats_against_its_nodes_room():
    """What a node's workers hold is the job's, not the node's others': a standby's RSS is in the view
    (held), and the running plan's room in the summary is net of it."""
    from elastic_zero.coordinator.memory_watch import MemoryWatch
    from elastic_zero.plan.membership import next_generation
    from elastic_zero.protocol import GenerationPlan, Source
    from elastic_zero.wire.heartbeats import Progress

    watch = MemoryWatch()
    for actor_id in ("w0", "w1", "w2"):
        watch.hello(actor_id, "n0", {"capacity": 16 * GIB, "threshold": 1.0, "rss": GIB, "model": MODEL})
    beats = {"w0": Progress(0, 3, 9, 3 * GIB, 3 * GIB, 9 * GIB), "w1": Progress(0, 3, 9, 3 * GIB, 3 * GIB, 9 * GIB),
             "w2": Progress(-1, -1, 0, 2 * GIB, 2 * GIB, 9 * GIB)}
    gen = next_generation(None, [Member("w0", node="n0"), Member("w1", node="n0")])
    plan = GenerationPlan(gen, None, ("w0", "w1"), (), Source.INIT, 0, (), "start", replicas=False)
    view = watch.view(beats, plan)
    assert view.held == {"w0": 3 * GIB, "w1": 3 * GIB, "w2": 2 * GIB} and view.rooms["n0"].others == GIB
    memory = watch.summary(view, plan)["plan"]
    assert memory["room_gib"] == 6.5 and memory["outside_plan_gib"] == 2.0  # (16 - 1 - 2) / 2


def test_a_retired_standbys_memory_on_its_way_out_retires_no_second_one():
    """Two standby workers of 2 GiB beside members of 4 GiB on a 13 GiB node (1 GiB others): one must
    go. Until the retired one's process is heard to end, its RSS is still in its node's used memory:
    read as the node's others, it would retire the second standby for room the first is giving back.
    Once its last word is heard, it is nobody's."""
    from elastic_zero.coordinator.memory_watch import MemoryWatch
    from elastic_zero.wire.heartbeats import LAST_WORD, Progress

    watch = MemoryWatch()
    for actor_id in ("w0", "w1", "w2", "w3"):
        watch.hello(actor_id, "n0", {"capacity": 13 * GIB, "threshold": 1.0, "rss": GIB, "model": MODEL})
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, standby=2)
    s, _, _ = decide(s, Start(), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", "w2", "w3"), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    used = GIB + 2 * 4 * GIB + 2 * 2 * GIB

    def beats_at(steps: int, used: int) -> dict:
        beats = {a: Progress(plan.number, steps, 0, 4 * GIB, int(4.5 * GIB), used) for a in ("w0", "w1")}
        return {**beats, **{a: Progress(-1, -1, 0, 2 * GIB, 2 * GIB, used) for a in ("w2", "w3")}}

    watch.view(beats_at(3, used), plan)  # the generation's first beats: its measure counts steps from there
    s, cmds, _ = decide(s, MemorySeen(watch.view(beats_at(5, used), plan)), 2.0)
    assert _cmd(cmds, Retire).actor_ids == ("w3",) and s.standby == 1
    watch.forget("w3", now=100.0)
    later = watch.view(beats_at(6, used), plan, now=101.0)  # w3's process not yet ended: its 2 GiB still in the node's used
    assert later.rooms["n0"].others == GIB and "w3" not in later.held
    s, cmds, _ = decide(s, MemorySeen(later), 2.5)
    assert _cmd(cmds, Retire) is None and [m.actor_id for m in s.ready] == ["w2"]
    gone = {**beats_at(7, used - 2 * GIB), "w3": Progress(-1, -1, 0, 2 * GIB, 2 * GIB, used, flags=LAST_WORD)}
    assert watch.view(gone, plan, now=102.0).rooms["n0"].others == GIB and watch.fading == {}
    # never heard to end (its node vanished, say): after FADING_S its memory is the node's others again
    watch.forget("w2", now=200.0)
    assert watch.view(gone, plan, now=229.0).rooms["n0"].others == GIB
    assert watch.view(gone, plan, now=231.0).rooms["n0"].others == 3 * GIB and watch.fading == {}


def test_a_memory_kill_does_not_retire_the_standby_its_recovery_takes():
    """A member killed for memory teaches the plan, before its generation's end is decided, that its
    shape needs more than the room it had beside the standby: that lesson (MemorySeen killed) retires
    nobody, and the recovery takes the standby in the dead worker's place at once."""
    rooms = {"n0": NodeRoom(16 * GIB, 1.0)}
    s = CoordinatorState(min_workers=2, max_workers=4, target=2, standby=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, _, _ = decide(s, MemorySeen(MemoryView(MODEL, rooms, int(1.5 * GIB), measured=True)), 0.0)
    s, cmds, _ = decide(s, _ready("w0", "w1", "w2"), 1.0)
    plan = _cmd(cmds, StartGeneration).plan
    view = MemoryView(MODEL, rooms, int(1.5 * GIB), measured=True, held={"w2": 2 * GIB})
    taught = view.killed(2, True, view.verdict(2, ["n0", "n0"], True, {"n0": 2 * GIB}).room)
    before = s
    s, cmds, _ = decide(s, MemorySeen(taught, killed=True), 3.0)
    assert cmds == () and s.standby == 1 and [m.actor_id for m in s.ready] == ["w2"]
    # (the same lesson heard as a plain measurement retires the standby: it crowds that shape)
    assert _cmd(decide(before, MemorySeen(taught), 3.0)[1], Retire).actor_ids == ("w2",)
    survivor = Outcome("w0", "failed", 5, (4, 5), (4, 5), snapshot_generation=plan.number)
    s, cmds, _ = decide(s, GenerationEnded((survivor,)), 3.0)
    recovered = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in recovered.generation.members] == ["w0", "w2"] and recovered.source == "snapshot"
