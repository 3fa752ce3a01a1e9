import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.layout import FlatLayout, ParamSpec, build_layout

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
specs = st.lists(
    st.tuples(shapes, st.sampled_from(["", "blocks.0", "blocks.1", "head"])), min_size=1, max_size=12
).map(lambda items: [ParamSpec(f"p{i}", shape, "float32", unit) for i, (shape, unit) in enumerate(items)])


@given(specs, st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_layout_places_every_parameter_aligned_without_overlap(params, align):
    layout = build_layout(params, align=align)
    assert [s.name for s in layout.slots] == sorted((p.name for p in params), key=lambda n: _unit_rank(params, n))
    covered = set()
    for slot in layout.slots:
        assert slot.offset % align == 0
        assert slot.numel == math.prod(slot.shape)
        unit = layout.units[slot.unit]
        assert unit.offset <= slot.offset and slot.end <= unit.end
        span = set(range(slot.offset, slot.end))
        assert not covered & span
        covered |= span
    assert sum(u.numel for u in layout.units) == layout.total
    assert layout.param_numel == sum(math.prod(p.shape) for p in params)
    assert layout.total - layout.param_numel < align * len(params) + 1


def _unit_rank(params, name):
    order = list(dict.fromkeys(p.unit for p in params))
    idx = [p.name for p in params].index(name)
    return (order.index(params[idx].unit), idx)


@given(specs, st.integers(1, 8))
@settings(max_examples=100, deadline=None)
def test_layout_round_trips_through_a_plain_dict(params, align):
    layout = build_layout(params, align=align)
    assert FlatLayout.from_dict(layout.to_dict()) == layout


def test_bad_layouts_name_what_is_wrong():
    with pytest.raises(ValueError, match="no parameters"):
        build_layout([])
    with pytest.raises(ValueError, match="'a' appears twice"):
        build_layout([ParamSpec("a", (2,), "float32", ""), ParamSpec("a", (3,), "float32", "")])
    with pytest.raises(ValueError, match="dtype 'int8'"):
        build_layout([ParamSpec("a", (2,), "int8", "")])
    data = build_layout([ParamSpec("a", (2, 3), "float32", "")], align=4).to_dict()
    data["slots"][0]["numel"] = 5
    with pytest.raises(ValueError, match="slot 'a': numel 5"):
        FlatLayout.from_dict(data)
    with pytest.raises(ValueError, match="malformed"):
        FlatLayout.from_dict({"units": []})


def test_mismatch_lists_the_first_differing_parameters():
    a = build_layout([ParamSpec("w", (4, 4), "float32", ""), ParamSpec("b", (4,), "float32", "")])
    b = build_layout([ParamSpec("w", (4, 5), "float32", ""), ParamSpec("c", (4,), "float32", "")])
    text = a.describe_mismatch(b)
    assert "w: (4,4) vs (4,5)" in text and "b: (4) vs missing" in text and "c: missing vs (4)" in text
    assert a.describe_mismatch(a) == ""
