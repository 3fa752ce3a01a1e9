"""The stuck rule (plan/stuck.py), pure: the clock is an argument. Oracles: a timeline made by hand,
whose laggard and moments are known; a straggler that moves once a period shorter than the bound."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.stuck import PHASE_ORDER, Where, judged_members, still_past, stuck_bound_s, stuck_members

pytestmark = pytest.mark.unit


def _at(steps, phase, collectives=0, generation=4):
    return Where(generation, steps, phase, collectives)


def test_the_bound_is_steps_of_the_measured_step_at_least_the_floor_and_none_before_a_step_or_when_off():
    assert stuck_bound_s(0.1, 3.0, 2.0) == 2.0
    assert stuck_bound_s(1.5, 3.0, 2.0) == 4.5
    assert stuck_bound_s(None, 3.0, 2.0) is None
    assert stuck_bound_s(1.5, 0.0, 2.0) is None


def test_a_member_behind_its_peers_and_still_past_the_bound_is_stuck_with_the_reason():
    where = {"w0": _at(20, "compute", 1), "w1": _at(20, "data"), "w2": _at(20, "compute", 1)}
    moved = {"w0": 10.5, "w1": 10.0, "w2": 10.6}
    assert stuck_members(where, moved, where, 4, 0, now=11.9, bound_s=2.0)[0] == ()  # not yet
    stuck, reason = stuck_members(where, moved, where, 4, 0, now=12.1, bound_s=2.0)
    assert stuck == ("w1",)
    assert reason == ("w1 did not move for 2.1 s (bound 2.0 s) at step 20 (data, collective 0) while w0, w2 "
                      "went on to step 20 (compute, collective 1)")


def test_time_spent_waiting_for_a_cpu_is_not_standing_still():
    """A starved worker stands as still as a hung one: what its process waited for a core is taken
    off its stillness."""
    where = {"w0": _at(20, "compute", 1), "w1": _at(20, "compute"), "w2": _at(20, "compute")}
    moved = {"w0": 10.0, "w1": 10.0, "w2": 10.0}
    stuck, reason = stuck_members(where, moved, where, 4, 0, now=13.0, bound_s=2.0, starved_s={"w1": 2.5, "w2": 0.5})
    assert stuck == ("w2",), reason
    assert reason == ("w2 did not move for 2.5 s (bound 2.0 s; 0.5 s more waiting for a CPU, not counted) at step 20 "
                      "(compute, collective 0) while w0 went on to step 20 (compute, collective 1)")
    nobody, why = stuck_members(where, moved, where, 4, 0, now=13.0, bound_s=2.0, starved_s={"w1": 2.5, "w2": 1.1})
    assert nobody == () and why == "w1, w2 stood still past the bound, waiting for a CPU: starved, not stuck"


def test_a_hang_before_a_collective_the_others_entered_is_told_apart_by_the_counts():
    where = {"w0": _at(7, "compute", 2), "w1": _at(7, "compute", 1)}
    assert stuck_members(where, {"w0": 0.0, "w1": 0.0}, where, 4, 0, now=5.0, bound_s=2.0)[0] == ("w1",)


def test_nobody_is_stuck_when_all_are_at_one_place_or_the_one_behind_enters_or_is_of_another_generation():
    same = {"w0": _at(9, "compute", 3), "w1": _at(9, "compute", 3)}
    assert stuck_members(same, {"w0": 0.0, "w1": 0.0}, same, 4, 0, now=60.0, bound_s=2.0)[0] == ()
    entering = {"w0": _at(9, "compute", 1), "w1": Where(4, 9, "entering", 0)}  # restoring: its peers wait by design
    assert stuck_members(entering, {"w0": 0.0, "w1": 0.0}, entering, 4, 0, now=60.0, bound_s=2.0)[0] == ()
    older = {"w0": _at(9, "compute", 1), "w1": _at(3, "data", generation=3)}  # its beat from before: not judged
    assert stuck_members(older, {"w0": 0.0, "w1": 0.0}, older, 4, 0, now=60.0, bound_s=2.0)[0] == ()
    assert stuck_members(same, {}, same, 4, 0, now=60.0, bound_s=None)[0] == ()


def test_a_joiner_in_the_generations_first_step_is_not_judged_a_member_from_before_is():
    """That step pays a joiner's one-off costs (CUDA's handles, kernels' first runs)."""
    where = {"w0": _at(12, "compute", 1), "w1": _at(12, "compute")}
    moved = {"w0": 0.0, "w1": 0.0}
    assert stuck_members(where, moved, where, 4, 12, now=60.0, bound_s=2.0, joiners={"w1"})[0] == ()
    assert stuck_members(where, moved, where, 4, 11, now=60.0, bound_s=2.0, joiners={"w1"})[0] == ("w1",)
    assert stuck_members(where, moved, where, 4, 12, now=60.0, bound_s=2.0)[0] == ("w1",)


def test_only_the_watched_are_judged_and_a_member_never_seen_moving_counts_from_now():
    where = {"w0": _at(5, "agree"), "w1": _at(5, "data"), "w2": _at(5, "data")}
    assert stuck_members(where, {"w0": 0.0, "w1": 0.0}, ["w0", "w1"], 4, 0, now=9.0, bound_s=2.0)[0] == ("w1",)
    assert stuck_members(where, {"w0": 0.0}, where, 4, 0, now=9.0, bound_s=2.0)[0] == ()


@settings(max_examples=200, deadline=None)
@given(period=st.floats(0.01, 1.99), ranks=st.integers(2, 6), laps=st.integers(1, 400), offset=st.floats(0, 1.99))
def test_a_straggler_that_moves_within_the_bound_is_never_stuck(period, ranks, laps, offset):
    """A straggler behind every peer whatever its lap, moving once every `period` (< the 2 s bound):
    looked at any moment up to a period after its last move, it is never stuck."""
    steps, phase = divmod(laps, len(PHASE_ORDER) - 2)
    straggler = _at(steps, PHASE_ORDER[2 + phase])
    peers = {f"w{i}": _at(steps + 1, "data", 5) for i in range(1, ranks)}
    where = {"w0": straggler, **peers}
    last_move = laps * period
    moved = {"w0": last_move, **{a: 0.0 for a in peers}}
    now = last_move + min(offset, period)
    assert stuck_members(where, moved, where, 4, -1, now=now, bound_s=2.0)[0] == ()


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(PHASE_ORDER), st.integers(0, 2), st.sampled_from([3, 4]),
                          st.one_of(st.none(), st.floats(0, 10)), st.floats(0, 3)), min_size=2, max_size=8),
       st.floats(0.5, 4.0), st.floats(5.0, 15.0))
def test_only_members_still_past_the_bound_and_judged_can_be_stuck(members, bound_s, now):
    """The coordinator asks still_past() and judged_members() first and skips the rule when they name
    nobody in common: so every member the rule finds stuck must be among those both name."""
    where = {f"w{i}": _at(steps, phase, collectives, generation)
             for i, (steps, phase, collectives, generation, _, _) in enumerate(members)}
    moved = {f"w{i}": m for i, (*_, m, _) in enumerate(members) if m is not None}
    starved = {f"w{i}": s for i, (*_, s) in enumerate(members)}
    stuck, _ = stuck_members(where, moved, where, 4, 0, now, bound_s, starved_s=starved)
    assert set(stuck) <= set(still_past(moved, where, now, bound_s)) & set(judged_members(where, where, 4))
