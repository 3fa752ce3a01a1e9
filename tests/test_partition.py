import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.layout import ParamSpec, build_layout
from elastic_zero.plan.partition import Partition, partition_layout, shard_pieces

layouts = st.builds(
    lambda items, align: build_layout(
        [ParamSpec(f"p{i}", shape, "float32", unit) for i, (shape, unit) in enumerate(items)], align=align
    ),
    st.lists(
        st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=2).map(tuple), st.sampled_from(["", "u1", "u2"])),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 8),
)


@given(layouts, st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_ranges_cover_each_unit_exactly_once_and_balanced(layout, world):
    part = partition_layout(layout, world)
    seen = []
    for rank in range(world):
        for unit, r in enumerate(part.ranges(rank)):
            assert 0 <= r.numel <= part.chunks[unit]
            seen.extend(range(r.start, r.stop))
            for i in (r.start, r.stop - 1) if r.numel else ():
                assert part.owner(i) == rank
    assert sorted(seen) == list(range(layout.total))
    for unit, span in enumerate(layout.units):
        chunk = part.chunks[unit]
        assert chunk % layout.align == 0
        assert chunk * world >= span.numel
        assert chunk < -(-span.numel // world) + layout.align  # no more than alignment beyond an even split
    assert part.shard_numel == sum(part.chunks)
    # a rank's real elements: what its ranges hold, within its padded buffer, all ranks' adding up to the layout
    numels = [part.rank_numel(rank) for rank in range(world)]
    assert numels == [len({i for r in part.ranges(rank) for i in range(r.start, r.stop)}) for rank in range(world)]
    assert all(n <= part.shard_numel for n in numels) and sum(numels) == layout.total


@given(layouts, st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_pieces_hold_every_parameter_element_once(layout, world):
    part = partition_layout(layout, world)
    held = {s.name: [] for s in layout.slots}
    for rank in range(world):
        used = []
        for piece in shard_pieces(layout, part, rank):
            slot = layout.slots[piece.slot]
            held[slot.name].extend(range(piece.param_offset, piece.param_offset + piece.numel))
            assert 0 <= piece.shard_offset and piece.shard_offset + piece.numel <= part.shard_numel
            # the piece sits where the unit's chunk puts that flat element
            flat = slot.offset + piece.param_offset
            unit_start = part.unit_offsets[slot.unit] + rank * part.chunks[slot.unit]
            assert piece.shard_offset == part.shard_unit_offset(slot.unit) + flat - unit_start
            used.extend(range(piece.shard_offset, piece.shard_offset + piece.numel))
        assert len(used) == len(set(used))
    for slot in layout.slots:
        assert sorted(held[slot.name]) == list(range(slot.numel))


def test_partition_round_trips_and_rejects_bad_ranks():
    layout = build_layout([ParamSpec("a", (10,), "float32", ""), ParamSpec("b", (3, 3), "float32", "u")])
    part = partition_layout(layout, 3)
    assert Partition.from_dict(part.to_dict()) == part
    with pytest.raises(ValueError, match="rank 3 is outside world size 3"):
        part.ranges(3)
    with pytest.raises(ValueError, match="world size must be >= 1"):
        partition_layout(layout, 0)
    with pytest.raises(IndexError, match="flat index 99"):
        part.owner(99)
