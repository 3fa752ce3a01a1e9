"""Which silent workers are lost: the pure rule of plan/liveness.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.plan.liveness import next_look_at, next_silence_at, nodes_gone_silent, silent_members

pytestmark = pytest.mark.unit


def test_a_member_silent_past_the_timeout_while_others_are_heard_is_lost():
    lost, reason = silent_members({"w0": 9.9, "w1": 8.5, "w2": 9.8}, ["w0", "w1", "w2"], now=10.0, timeout_s=1.0)
    assert lost == ("w1",)
    assert reason.startswith("no heartbeat from w1 for 1.5 s (timeout 1 s) while w0, w2 were heard")


def test_members_within_the_timeout_are_not_lost():
    assert silent_members({"w0": 9.9, "w1": 9.1}, ["w0", "w1"], now=10.0, timeout_s=1.0)[0] == ()


def test_nobody_is_lost_when_nobody_was_heard_lately():
    """The listener was starved (or every member went at once): Ray's death notices decide then."""
    lost, reason = silent_members({"w0": 5.0, "w1": 5.5}, ["w0", "w1"], now=10.0, timeout_s=1.0)
    assert lost == () and "listener" in reason


def test_the_next_look_is_at_the_first_silence_due_or_later_when_the_listener_is_behind():
    """Oracle: the moments by hand. A silence due in the past with nobody declared (nobody heard:
    silent_members declined) is the listener's lag: the loop waits for it, not 2 ms."""
    heard = {"w0": 10.0, "w1": 10.4}
    due = next_silence_at(heard, heard, now=10.5, timeout_s=1.0)
    assert due == 11.0
    assert next_look_at(10.5, due, poll_s=0.5, min_gap_s=0.002, behind_s=0.1) == pytest.approx(11.0)  # due, a poll away
    assert next_look_at(10.2, 11.0, poll_s=0.5, min_gap_s=0.002, behind_s=0.1) == pytest.approx(10.7)  # at most a poll away
    assert next_look_at(10.5, None, poll_s=0.5, min_gap_s=0.002, behind_s=0.1) == pytest.approx(10.502)
    stalled = {"w0": 5.0, "w1": 5.1}  # nobody heard for 5 s: silent_members declares nobody
    now = 10.0
    assert silent_members(stalled, stalled, now, 1.0)[0] == ()
    assert next_look_at(now, next_silence_at(stalled, stalled, now, 1.0), 0.5, 0.002, 0.1) == pytest.approx(10.1)


def test_the_others_must_have_been_heard_within_half_the_timeout():
    heard_at = {"w0": 8.0, "w1": 9.3}  # w1: 0.7 s ago, more than half the timeout
    assert silent_members(heard_at, ["w0", "w1"], now=10.0, timeout_s=1.0)[0] == ()
    heard_at["w1"] = 9.6
    assert silent_members(heard_at, ["w0", "w1"], now=10.0, timeout_s=1.0)[0] == ("w0",)


def test_witnesses_outside_the_generation_count_as_heard():
    """The first of a node's workers to be declared lost has left the generation; its node-mate,
    now the only one watched, is read against the others, who finished their part and still beat."""
    heard_at = {"w1": 8.9, "w0": 9.9, "w2": 9.95}
    assert silent_members(heard_at, ["w1"], now=10.0, timeout_s=1.0)[0] == ()
    assert silent_members(heard_at, ["w1"], now=10.0, timeout_s=1.0, witnesses=["w0", "w2"])[0] == ("w1",)
    assert silent_members({"w1": 8.9, "w0": 9.0}, ["w1"], now=10.0, timeout_s=1.0, witnesses=["w0"])[0] == ()


def test_a_member_never_heard_of_is_not_yet_silent_and_the_unwatched_are_ignored():
    lost, _ = silent_members({"w0": 9.9, "old": 0.0}, ["w0", "w9"], now=10.0, timeout_s=1.0)
    assert lost == ()


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f"w{i}" for i in range(6)]), st.floats(0, 20), min_size=1),
       st.floats(0.2, 5))
def test_the_lost_are_watched_silent_members_and_someone_was_heard(heard_at, timeout_s):
    now = 20.0
    watched = sorted(heard_at)
    lost, reason = silent_members(heard_at, watched, now, timeout_s)
    assert set(lost) <= set(watched)
    assert all(now - heard_at[a] > timeout_s for a in lost)
    if lost:
        assert any(now - heard_at[a] <= timeout_s / 2 for a in watched)
    else:
        silent = [a for a in watched if now - heard_at[a] > timeout_s]
        assert not silent or all(now - heard_at[a] > timeout_s / 2 for a in watched)
    assert reason


def test_a_node_is_lost_only_when_none_of_its_workers_is_heard():
    node_of = {"w0": "head", "w1": "head", "w2": "b", "w3": "b", "w4": "c"}
    heard = {"w0": 8.0, "w1": 9.9, "w2": 8.2, "w3": 8.1, "w4": 9.9}
    # w0 alone went silent on a node where w1 is heard: its process, not its node
    assert nodes_gone_silent(["w0"], node_of, heard, now=10.0, timeout_s=1.0) == set()
    # both workers of b silent: b is gone; c, heard, is not named
    assert nodes_gone_silent(["w2", "w3"], node_of, heard, now=10.0, timeout_s=1.0) == {"b"}
    # a worker whose node is unknown names no node
    assert nodes_gone_silent(["w9"], node_of, heard, now=10.0, timeout_s=1.0) == set()


def test_the_next_look_for_silence_is_when_the_least_recently_heard_would_pass_the_timeout():
    from elastic_zero.plan.liveness import next_silence_at

    heard = {"w0": 10.0, "w1": 9.4, "w2": 3.0}  # w2 is not watched
    assert next_silence_at(heard, ["w0", "w1"], now=10.0, timeout_s=1.0) == 10.4
    # one never heard counts from now; nobody watched: no time
    assert next_silence_at(heard, ["w0", "w9"], now=10.0, timeout_s=1.0) == 11.0
    assert next_silence_at(heard, [], now=10.0, timeout_s=1.0) is None
    # at that moment, and not before, silent_members finds the member
    assert silent_members(heard, ["w0", "w1"], now=10.39, timeout_s=1.0)[0] == ()
    assert silent_members(heard, ["w0", "w1"], now=10.41, timeout_s=1.0)[0] == ("w1",)
