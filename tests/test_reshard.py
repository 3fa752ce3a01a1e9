import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.layout import ParamSpec, build_layout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.plan.reshard import plan_reshard, received_from_others, sends_and_receives, vector_offsets

layouts = st.builds(
    lambda sizes, align: build_layout(
        [ParamSpec(f"p{i}", (n,), "float32", unit) for i, (n, unit) in enumerate(sizes)], align=align
    ),
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["", "a", "b"])), min_size=1, max_size=6),
    st.integers(1, 4),
)


def _vectors(partition, total):
    """Each rank's shard vector filled with the flat indices it holds: the oracle of a move."""
    out = []
    for rank in range(partition.world_size):
        vec = []
        for r in partition.ranges(rank):
            vec.extend(range(r.start, r.stop))
        out.append(vec)
    return out


@given(layouts, st.integers(1, 7), st.integers(1, 7))
@settings(max_examples=300, deadline=None)
def test_executing_the_plan_builds_exactly_the_new_shards(layout, n_old, n_new):
    old, new = partition_layout(layout, n_old), partition_layout(layout, n_new)
    plan = plan_reshard(old, new)
    src = _vectors(old, layout.total)
    want = _vectors(new, layout.total)
    got = [[None] * len(v) for v in want]
    for t in plan:
        piece = src[t.src][t.src_offset : t.src_offset + t.numel]
        assert piece == list(range(t.flat_offset, t.flat_offset + t.numel))
        for i, value in enumerate(piece):
            assert got[t.dst][t.dst_offset + i] is None, "an element arrives twice"
            got[t.dst][t.dst_offset + i] = value
    assert got == want
    assert len(plan) <= len(layout.units) * (n_old + n_new - 1)


@given(layouts, st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_same_partition_moves_nothing_between_ranks(layout, n):
    part = partition_layout(layout, n)
    assert all(t.src == t.dst for t in plan_reshard(part, part))


def test_plan_refuses_partitions_of_different_layouts_and_splits_roles():
    a = build_layout([ParamSpec("w", (10,), "float32", "")])
    b = build_layout([ParamSpec("w", (11,), "float32", "")])
    with pytest.raises(ValueError, match="different layouts"):
        plan_reshard(partition_layout(a, 2), partition_layout(b, 2))
    plan = plan_reshard(partition_layout(a, 2), partition_layout(a, 3))
    sends, receives = sends_and_receives(plan, rank_old=1, rank_new=None)
    assert sends and not receives and all(t.src == 1 for t in sends)
    assert vector_offsets(partition_layout(a, 3), 2) == (0,)


@given(layouts, st.integers(1, 6), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_what_a_process_receives_from_others_is_its_new_shard_less_what_it_held(layout, n_old, n_new):
    """Oracle: element by element, a new rank's elements whose old owner sits in another process.
    Processes: old rank r and new rank r are one process (a scale-up or down keeps the first ranks)."""
    old, new = partition_layout(layout, n_old), partition_layout(layout, n_new)
    plan = plan_reshard(old, new)
    processes = max(n_old, n_new)
    holder_of_old, member_of_new = list(range(n_old)), list(range(n_new))
    owner = {i: r for r in range(n_old) for rg in old.ranges(r) for i in range(rg.start, rg.stop)}
    for me in range(processes):
        wanted = [i for rg in (new.ranges(me) if me < n_new else ()) for i in range(rg.start, rg.stop)]
        expected = sum(1 for i in wanted if owner[i] != me)
        assert received_from_others(plan, holder_of_old, member_of_new, me) == expected
