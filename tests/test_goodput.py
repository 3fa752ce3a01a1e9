"""The goodput benchmark's pure parts (bench/goodput_schedule.py): the schedule and the accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.bench.goodput_schedule import ACTIONS, START_NODES, goodput, goodput_schedule, kept_steps

pytestmark = pytest.mark.unit


@settings(max_examples=200, deadline=None)
@given(window=st.floats(400, 3600), seed=st.integers(0, 10**6), notice=st.floats(1, 35))
def test_the_schedule_is_ordered_and_each_node_is_used_as_it_exists(window, seed, notice):
    schedule = goodput_schedule(window, seed, notice)
    assert [e.action for e in schedule] == ["node_lost", "node_back", "notice", "preempted", "scale_up", "end"]
    assert all(a.at_s < b.at_s for a, b in zip(schedule, schedule[1:])), schedule
    assert schedule[-1].at_s == window and set(e.action for e in schedule) <= set(ACTIONS)
    alive = set(START_NODES)
    for event in schedule:  # a node is told, lost or replaced only while it is there
        if event.node is not None and event.action != "scale_up":
            assert event.node in alive, event
        if event.action in ("node_back", "preempted"):
            alive.discard(event.node)
        alive.update(n for n in (event.replaced_by, event.node if event.action == "scale_up" else None) if n)
    notice = next(e for e in schedule if e.action == "notice")
    preempted = next(e for e in schedule if e.action == "preempted")
    assert preempted.at_s == pytest.approx(notice.at_s + notice.deadline_s, abs=0.1)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert goodput_schedule(600, 3) == goodput_schedule(600, 3)
    assert goodput_schedule(600, 3) != goodput_schedule(600, 4)


@pytest.mark.parametrize("window, notice, message", [
    (200, 30, "window_s 200 is too short for a 30 s notice: need window_s > 333"),
    (600, 0, "notice_s must be > 0, got 0"),
])
def test_a_window_too_short_for_its_notice_is_refused_by_name(window, notice, message):
    with pytest.raises(ValueError, match=message):
        goodput_schedule(window, 0, notice)


def test_a_step_recomputed_after_a_restart_counts_once_in_its_last_run():
    """Steps 0-5 in a first attempt, a restart from the checkpoint at 3: steps 3-5 run again;
    the kept runs are the later ones, three runs were thrown away."""
    first = [{"step": s, "started": s, "done": s + 0.5, "attempt": "x"} for s in range(6)]
    second = [{"step": s, "started": 10 + s, "done": 10 + s + 0.8, "attempt": "y"} for s in range(3, 8)]
    kept, redone = kept_steps(second + first)  # in any order
    assert redone == 3 and sorted(kept) == list(range(8))
    assert [kept[s]["attempt"] for s in range(8)] == ["x"] * 3 + ["y"] * 5
    assert goodput([r["done"] - r["started"] for r in kept.values()], wall_s=10.0) == pytest.approx(0.55)


def test_goodput_needs_a_positive_wall_time():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        goodput([1.0], 0)
