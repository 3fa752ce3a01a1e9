"""A worker's watch over its coordinator (worker/coordinator_watch.py), against a real relay and
store (wire/rendezvous.py) in a process of its own, killed as a coordinator's would be. Oracles: a
watch over a store that lives calls nothing; one whose store dies calls on_lost at once, and
on_given_up after its wait unless a replacement took the worker over first."""

import functools
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from elastic_zero.wire.rendezvous import new_secret
from elastic_zero.worker.coordinator_link import _watch_connection
from elastic_zero.worker.coordinator_watch import CoordinatorWatch

pytestmark = pytest.mark.unit


def _serve(secret, ports):
    from elastic_zero.wire.rendezvous import RendezvousServer

    server = RendezvousServer("127.0.0.1", secret, 30.0)
    ports.put(server.port)
    threading.Event().wait()  # until killed: the relay ends with this process


class _Coordinator:
    """A store in a process of its own, as a coordinator's relay serves it."""

    def __init__(self):
        self.secret, ports = new_secret(), mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(self.secret, ports), daemon=True)
        self.proc.start()
        self.port = ports.get(timeout=60)

    def connect(self):
        return functools.partial(_watch_connection, "127.0.0.1", self.port, self.secret)

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def _watch(coordinator, wait_s):
    lost, given_up = threading.Event(), threading.Event()
    return CoordinatorWatch(coordinator.connect(), wait_s, lost.set, given_up.set), lost, given_up


def test_a_lost_store_is_noticed_at_once_and_the_worker_gives_up_after_its_wait():
    first = _Coordinator()
    watch, lost, given_up = _watch(first, wait_s=1.0)
    assert not lost.wait(1.5) and not watch.lost  # the store lives: nothing
    killed = time.monotonic()
    first.kill()
    assert lost.wait(10) and watch.lost
    noticed = time.monotonic() - killed
    assert not given_up.is_set()
    assert given_up.wait(10) and time.monotonic() - killed >= 1.0
    # the closed connection, not the wait's end (a day): at most REACH_TRIES answers tried, a second apart
    # (a connection made while the relay's process ends is reset, not refused: seen here under load)
    assert noticed < 5.0, noticed


def test_a_worker_taken_over_in_time_follows_the_new_store_and_does_not_give_up():
    first, second = _Coordinator(), _Coordinator()
    watch, lost, given_up = _watch(first, wait_s=3.0)
    first.kill()
    assert lost.wait(10)
    lost.clear()
    watch.taken_over(second.connect())
    assert not given_up.wait(4.0) and not watch.lost  # past the first wait: the new store lives
    second.kill()
    assert lost.wait(10) and given_up.wait(10)  # the new store's loss is noticed too


def test_a_worker_being_taken_over_does_not_give_up_while_it_is():
    first = _Coordinator()
    watch, lost, given_up = _watch(first, wait_s=1.0)
    first.kill()
    assert lost.wait(10)
    watch.hold()  # take_over() began: its generation may take longer than the wait to end
    assert not given_up.wait(2.5)
