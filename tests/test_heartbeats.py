"""Heartbeats as datagrams (heartbeats.py): real UDP sockets on loopback."""

import multiprocessing
import time

import pytest

from elastic_zero.heartbeats import DRAIN_EVERY_S, MIN_DRAIN_WAIT_S, HeartbeatListener, HeartbeatSender, drain_wait_s

pytestmark = pytest.mark.unit


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_beat_is_stamped_with_the_start_of_the_drain_that_read_it():
    """At most a drain's wait after the beat came (more only if the listener was starved), and never
    before the drain began."""
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    try:
        before = time.monotonic()
        HeartbeatSender("127.0.0.1", listener.port, b"s" * 32).beat("w7")
        after = time.monotonic()
        assert _until(lambda: "w7" in listener.heard)
        assert before - DRAIN_EVERY_S <= listener.heard["w7"] <= after + DRAIN_EVERY_S + listener.longest_pause_s
    finally:
        listener.close()


def test_the_wait_between_drains_shrinks_as_beats_come_faster():
    assert drain_wait_s(0, 0.05, 4096) == DRAIN_EVERY_S  # nobody beating yet
    assert drain_wait_s(3, 0.05, 4096) == DRAIN_EVERY_S  # 3 workers: the longest wait
    # 1,024 workers' 10,240 beats a second against a kernel's default buffer (about 200 beats at our
    # generous size): drained before half of it fills, but never in a busy loop
    assert drain_wait_s(512, 0.05, 200) == pytest.approx(100 / 10240)
    assert drain_wait_s(10**6, 0.05, 200) == MIN_DRAIN_WAIT_S


def test_a_thousand_workers_beating_ten_times_a_second_are_never_silent():
    """Sustained, as from a cluster: at every look, every worker was heard within the job's default
    heartbeat timeout (1 s; ten beats, so that a starved sender on a loaded machine is no failure)."""
    listener = HeartbeatListener("127.0.0.1", b"s" * 32)
    context = multiprocessing.get_context("spawn")
    beating = context.Process(target=_beat_for, args=(listener.port, 1024, 3.0), daemon=True)
    try:
        beating.start()
        assert _until(lambda: len(listener.heard) == 1024, 20)
        oldest = []
        while beating.is_alive():
            now = time.monotonic()
            oldest.append(now - min(listener.heard.values()))
            time.sleep(0.02)
        assert len(oldest) > 10 and max(oldest[:-5]) < 1.0, max(oldest)  # the last looks come as beating stops
    finally:
        beating.kill()
        listener.close()


def _beat_for(port: int, workers: int, seconds: float) -> None:
    sender = HeartbeatSender("127.0.0.1", port, b"s" * 32)
    ids = [f"w{i}" for i in range(workers)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        for actor_id in ids:
            sender.beat(actor_id)
        time.sleep(max(0.0, 0.1 - (time.monotonic() - began)))


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
