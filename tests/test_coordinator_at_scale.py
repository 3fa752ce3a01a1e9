"""The coordinator's pure decisions with a thousand members: the properties that must hold at the
sizes users run (timings belong to `bench control-plane`)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.coordinator.state import (
    CoordinatorState, GenerationEnded, RequestSafePoint, ScaleRequested, Spawn, Start, StartGeneration, WorkersReady,
    decide,
)
from elastic_zero.plan.membership import Member, place_buddies
from elastic_zero.protocol import Outcome

pytestmark = pytest.mark.unit

N = 1024


def _members(first: int, count: int, per_node: int):
    return tuple(Member(f"w{i}", node=f"node-{i // per_node}") for i in range(first, first + count))


def _start(per_node: int):
    s = CoordinatorState(min_workers=N // 2, max_workers=N + 64, target=N, min_wait_s=30, join_window_s=0)
    s, cmds, _ = decide(s, Start(), 0.0)
    assert cmds == (Spawn(N),)
    s, cmds, _ = decide(s, WorkersReady(_members(0, N, per_node)), 1.0)
    (start,) = cmds
    return s, start.plan


@settings(max_examples=8, deadline=None)
@given(per_node=st.sampled_from([4, 8, 16]), lost_node=st.integers(0, N // 16 - 1), data=st.data())
def test_a_lost_node_among_1024_is_restored_from_its_buddies_at_the_latest_step_every_rank_holds(per_node, lost_node,
                                                                                               data):
    s, plan = _start(per_node)
    gen = plan.generation
    assert gen.world_size == N and sorted(m.actor_id for m in gen.members) == sorted(f"w{i}" for i in range(N))
    # every buddy on another node: a lost node never takes a shard and its replica together
    assert all(gen.members[r].node != gen.members[b].node for r, b in enumerate(gen.buddies))
    lost = {m.actor_id for m in gen.members if m.node == f"node-{lost_node}"}
    # the survivors stopped a step apart (an abort reaches them at different moments); each holds two steps
    reached = {m.actor_id: data.draw(st.sampled_from([40, 41])) for m in gen.members if m.actor_id not in lost}
    outcomes = tuple(Outcome(a, "failed", step, own_steps=(step - 1, step), ward_steps=(step - 1, step),
                             snapshot_generation=plan.number) for a, step in reached.items())
    s, cmds, reason = decide(s, GenerationEnded(outcomes), 10.0)
    start = next(c for c in cmds if isinstance(c, StartGeneration))
    new = start.plan
    held = {}
    for rank, m in enumerate(gen.members):
        mine = m.actor_id if m.actor_id in reached else gen.members[gen.buddies[rank]].actor_id
        held[rank] = {reached[mine] - 1, reached[mine]}
    assert new.source == "snapshot" and new.step == max(set.intersection(*held.values())), reason
    assert [m.actor_id for m in new.generation.members] == [m.actor_id for m in gen.members if m.actor_id not in lost]
    # every old rank's shard comes from a survivor: its own, or its buddy's replica
    for rank, m in enumerate(gen.members):
        holder = new.participants[new.holder_of_old[rank]]
        assert holder in reached
        assert holder == m.actor_id or (m.actor_id in lost and holder == gen.members[gen.buddies[rank]].actor_id)


@settings(max_examples=5, deadline=None)
@given(per_node=st.sampled_from([4, 8]))
def test_64_joiners_join_1024_at_one_safe_point_and_nobody_moves(per_node):
    s, plan = _start(per_node)
    s, cmds, _ = decide(s, ScaleRequested(N + 64), 5.0)
    assert cmds == (Spawn(64),)
    s, cmds, _ = decide(s, WorkersReady(_members(N, 64, per_node)), 6.0)
    assert cmds == (RequestSafePoint(),)
    outcomes = tuple(Outcome(m.actor_id, "safe_point", 30, own_steps=(30,), ward_steps=(30,),
                             snapshot_generation=plan.number) for m in plan.generation.members)
    s, cmds, _ = decide(s, GenerationEnded(outcomes), 7.0)
    (start,) = cmds
    new = start.plan
    ids = [m.actor_id for m in new.generation.members]
    assert new.source == "live" and new.step == 30 and len(ids) == N + 64
    assert ids[:N] == [m.actor_id for m in plan.generation.members]  # every old rank keeps its rank
    assert new.holder_of_old == tuple(range(N))


def _every_shift(members):
    """The buddy placement by its definition: every shift of the ring scored (the oracle)."""
    n = len(members)
    if n <= 1:
        return tuple(range(n))
    ring = sorted(range(n), key=lambda r: (members[r].zone, members[r].node, r))

    def score(shift):
        pairs = [(members[ring[i]], members[ring[(i + shift) % n]]) for i in range(n)]
        return (sum((a.zone, a.node) != (b.zone, b.node) for a, b in pairs), sum(a.zone != b.zone for a, b in pairs))

    best = max(range(1, n), key=lambda s: (score(s), -s))
    buddies = [0] * n
    for i in range(n):
        buddies[ring[i]] = ring[(i + best) % n]
    return tuple(buddies)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=40))
def test_the_buddy_placement_that_stops_at_the_bound_is_the_placement_of_every_shift_scored(domains):
    members = [Member(f"w{i}", node=f"n{node}", zone=f"z{zone}") for i, (node, zone) in enumerate(domains)]
    assert place_buddies(members) == _every_shift(members)


class _CountingStore:
    """A real store, its writes counted."""

    def __init__(self, store):
        self.store, self.writes = store, []

    def set(self, key, value):
        self.writes.append((key, value))
        self.store.set(key, value)


def test_a_failed_generation_is_aborted_once_for_all_whatever_the_number_of_failure_reports():
    """Every survivor reports the failure too; aborting everyone on each report was 1,024^2 calls.
    Once was still a Ray call per survivor (1,016 from the loop); now it is one store write."""
    from types import SimpleNamespace

    from elastic_zero.coordinator.generation_run import GenerationRun
    from elastic_zero.coordinator.generations import Generations
    from elastic_zero.wire.generation_ends import ABORTED, over_key
    from elastic_zero.wire.rendezvous import loopback_store

    _, plan = _start(per_node=8)
    sent = []  # the plan each participant was sent: no other call on a worker may be made
    handle = SimpleNamespace(train=SimpleNamespace(remote=lambda shared, stand: sent.append(shared) or object()))
    pool = SimpleNamespace(handle=lambda actor_id: handle)
    completions = SimpleNamespace(watch=lambda ref: None)
    store = _CountingStore(loopback_store(10))
    generations = Generations(SimpleNamespace(faults=()), pool, None, None, store, completions)
    generations.running = GenerationRun(plan, pool, completions)  # the failure path alone: no Ray
    assert len(sent) == N and all(s is sent[0] for s in sent)  # packed once, for all
    for _ in range(50):  # the first report, then 49 more survivors' reports of the same failure
        generations.failed()
    assert store.writes == [(over_key(plan.number), ABORTED)] and store.store.get(over_key(plan.number)) == ABORTED
