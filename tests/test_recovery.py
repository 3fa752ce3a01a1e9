from elastic_zero.plan.membership import Member, next_generation
from elastic_zero.plan.recovery import lost_ranks, restore_point


def _gen(n):
    return next_generation(None, [Member(f"a{i}", node=f"n{i}") for i in range(n)])


def test_a_lost_rank_is_restored_from_its_buddy_at_the_latest_common_step():
    g = _gen(3)
    dead = g.members[1].actor_id
    buddy_of_dead = g.members[g.buddies[1]].actor_id
    survivors = [m.actor_id for m in g.members if m.actor_id != dead]
    own = {a: (4, 5) for a in survivors}
    ward = {a: (4, 5) for a in survivors}
    ward[buddy_of_dead] = (4,)  # the replication of step 5 did not reach it
    step, holders = restore_point(g, survivors, own, ward)
    assert step == 4
    assert holders[1] == buddy_of_dead
    assert [h for r, h in enumerate(holders) if r != 1] == survivors
    assert lost_ranks(g, survivors) == (1,)


def test_a_shard_and_its_replica_both_lost_cannot_be_restored():
    g = _gen(4)
    r = 0
    b = g.buddies[r]
    survivors = [m.actor_id for i, m in enumerate(g.members) if i not in (r, b)]
    everything = {a: (1, 2) for a in survivors}
    assert restore_point(g, survivors, everything, everything) is None


def test_nothing_lost_restores_each_rank_from_itself():
    g = _gen(2)
    ids = [m.actor_id for m in g.members]
    assert restore_point(g, ids, {a: (7,) for a in ids}, {a: (7,) for a in ids}) == (7, tuple(ids))
