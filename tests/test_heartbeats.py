"""Heartbeats as datagrams (heartbeats.py): real UDP sockets on loopback."""

import time

import pytest

from elastic_zero.heartbeats import DRAIN_EVERY_S, HeartbeatListener, HeartbeatSender

pytestmark = pytest.mark.unit


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_beat_is_noted_with_a_time_its_sender_was_surely_alive():
    """Drained every DRAIN_EVERY_S, a beat is stamped with when the previous drain emptied the socket:
    never after the beat (a silence never looks shorter than it is), and at most about two drains
    before it."""
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    try:
        before = time.monotonic()
        HeartbeatSender("127.0.0.1", listener.port, b"s" * 32).beat("w7")
        after = time.monotonic()
        assert _until(lambda: "w7" in listener.heard)
        assert before - 2 * DRAIN_EVERY_S - listener.longest_pause_s <= listener.heard["w7"] <= after
    finally:
        listener.close()


def test_later_beats_move_the_stamp_on():
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    try:
        sender = HeartbeatSender("127.0.0.1", listener.port, b"s" * 32)
        sender.beat("w1")
        assert _until(lambda: "w1" in listener.heard)
        first = listener.heard["w1"]
        time.sleep(2 * DRAIN_EVERY_S)  # past a drain: the next beat lands in another
        sender.beat("w1")
        assert _until(lambda: listener.heard["w1"] > first)
    finally:
        listener.close()


def test_a_beat_without_the_jobs_token_is_dropped():
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    try:
        HeartbeatSender("127.0.0.1", listener.port, b"x" * 32).beat("intruder")
        HeartbeatSender("127.0.0.1", listener.port, b"s" * 32).beat("w0")  # datagrams on loopback keep their order
        assert _until(lambda: "w0" in listener.heard)
        assert "intruder" not in listener.heard
    finally:
        listener.close()


def test_a_thousand_workers_beating_at_once_are_all_heard():
    """A burst of 1,024 beats, as from a cluster's workers in one interval: the socket's buffer holds them."""
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    try:
        sender = HeartbeatSender("127.0.0.1", listener.port, b"s" * 32)
        for i in range(1024):
            sender.beat(f"w{i}")
        assert _until(lambda: len(listener.heard) == 1024)
    finally:
        listener.close()


def test_a_beat_to_a_closed_listener_is_lost_quietly():
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    listener.close()
    HeartbeatSender("127.0.0.1", listener.port, b"s" * 32).beat("w0")  # no error: the next beat counts
