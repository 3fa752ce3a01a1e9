"""The end of a generation through the store (generation_ends.py), on a real TCPStore: an abort
reaches the watch once, whenever it is said; an ended generation aborts nobody; a wait for a
generation known to be over is released; a store that goes ends the watch. Oracle: the calls of
abort() the watch makes, against what was announced."""

import gc
import queue
import threading

import pytest

from elastic_zero.wire.generation_ends import ABORTED, ENDED, GenerationEndWatch, announce_end, over_key
from elastic_zero.wire.rendezvous import loopback_store

pytestmark = pytest.mark.unit


def _client(server):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def server():
    return loopback_store(10)


def _watch(server):
    aborted: queue.SimpleQueue = queue.SimpleQueue()
    return GenerationEndWatch(_client(server), aborted.put), aborted


def test_an_abort_reaches_the_watch_of_its_generation(server):
    watch, aborted = _watch(server)
    watch.watch(3)
    announce_end(server, 3, aborted=True)
    assert aborted.get(timeout=10) == 3


def test_an_abort_said_before_the_watch_began_still_reaches_it(server):
    announce_end(server, 5, aborted=True)
    watch, aborted = _watch(server)
    watch.watch(5)
    assert aborted.get(timeout=10) == 5


def test_an_ended_generation_aborts_nobody_and_an_abort_said_first_stays(server):
    watch, aborted = _watch(server)
    watch.watch(1)
    announce_end(server, 1, aborted=False)
    watch.watch(2)
    announce_end(server, 2, aborted=True)
    announce_end(server, 2, aborted=False)  # the generation's normal end, after its abort
    assert aborted.get(timeout=10) == 2 and aborted.empty()
    assert server.get(over_key(1)) == ENDED and server.get(over_key(2)) == ABORTED


def test_a_wait_for_a_generation_known_to_be_over_is_released(server):
    """A newer generation means every one before it is over, even where its key was never set."""
    import time

    watch, aborted = _watch(server)
    watch.watch(6)  # its end is never announced
    deadline = time.monotonic() + 10
    while watch._waiting_for != 6 and time.monotonic() < deadline:  # the watch waits for 6 now
        time.sleep(0.01)
    watch.watch(7)
    announce_end(server, 7, aborted=True)
    assert aborted.get(timeout=10) == 7
    watch.watch(7)  # the same generation again (simulated hosts watch for each member): nothing new
    assert aborted.empty()


def test_the_watch_ends_with_the_store():
    server = loopback_store(10)
    before = set(threading.enumerate())
    watch, _ = _watch(server)
    watch.watch(0)
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "generation-ends"]
    del server
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
