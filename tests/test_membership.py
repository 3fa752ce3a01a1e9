from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.membership import Member, next_generation, place_buddies

clusters = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=10).map(
    lambda spots: [Member(f"a{i}", node=f"n{node}", zone=f"z{zone}") for i, (node, zone) in enumerate(spots)]
)


@given(clusters)
@settings(max_examples=300, deadline=None)
def test_buddies_are_a_derangement_that_leaves_the_node_when_it_can(members):
    buddies = place_buddies(members)
    n = len(members)
    assert sorted(buddies) == list(range(n))  # every rank holds exactly one replica
    if n > 1:
        assert all(b != r for r, b in enumerate(buddies))
    biggest_zone = max(Counter(m.zone for m in members).values())
    if n > 1 and biggest_zone * 2 <= n:
        assert all(members[r].zone != members[b].zone for r, b in enumerate(buddies))
    biggest_node_group = max(Counter((m.zone, m.node) for m in members).values())
    if n > 1 and biggest_node_group * 2 <= n:
        assert all((members[r].zone, members[r].node) != (members[b].zone, members[b].node)
                   for r, b in enumerate(buddies))


def test_generations_keep_survivor_order_and_append_newcomers():
    a, b, c, d = (Member(x, node=f"n{i % 2}") for i, x in enumerate("abcd"))
    g0 = next_generation(None, [c, a, b])
    assert g0.number == 0 and [m.actor_id for m in g0.members] == ["a", "b", "c"]
    g1 = next_generation(g0, [d, c, a])  # b died, d joined
    assert g1.number == 1 and [m.actor_id for m in g1.members] == ["a", "c", "d"]
    assert g1.rank_of("d") == 2
    with pytest.raises(KeyError, match="'b' is not a member of generation 1"):
        g1.rank_of("b")
    with pytest.raises(ValueError, match="unique"):
        next_generation(g1, [a, a])
    assert next_generation(None, [a]).buddies == (0,)
