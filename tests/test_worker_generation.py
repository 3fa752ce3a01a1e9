"""A worker's generation bookkeeping without Ray: safe-point requests and aborts that race with
the start of a generation. Oracle: the generation each message names."""

import threading

import pytest

import elastic_zero.worker.actor as actor_module
from elastic_zero.worker.actor import TrainingWorker

pytestmark = pytest.mark.unit


class _Group:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Plan:
    def __init__(self, number: int) -> None:
        self.number = number


def _bare_worker():
    """The parts of a worker that the control calls touch (its constructor builds a model and
    connects to a store)."""
    worker = object.__new__(TrainingWorker)
    worker._generation_lock = threading.Lock()
    worker._aborted = threading.Event()
    worker._safe_point_for = -1
    worker._generation = -1
    worker._pg = None
    worker.engine = None
    return worker


def test_a_safe_point_request_belongs_to_its_generation():
    """Seen before: a request that arrived after its generation had failed stopped the next one at
    its first step, for a change nobody had asked of it."""
    worker = _bare_worker()
    worker.request_safe_point(4)  # for a generation that has not started here yet: kept
    assert worker._safe_point_for == 4
    worker.request_safe_point(3)  # late, for a generation that is over: no effect on 4
    assert worker._safe_point_for == 4
    assert worker._safe_point_for != 5  # generation 5's loop is not asked to stop


def test_an_abort_that_comes_while_a_group_is_built_aborts_that_group(monkeypatch):
    """Seen before: the group was made current outside the lock, so an abort that came between
    the generation's start and the group's creation aborted the previous group, and the new one
    waited for the collective timeout."""
    worker = _bare_worker()
    worker.store, worker.backend = None, "gloo"
    worker.spec = type("Spec", (), {"elastic": type("E", (), {"collective_timeout_s": 5.0})})()
    worker._generation = 7
    old = worker._pg = _Group()
    built = _Group()

    def new_group(*args, **kwargs):
        worker.abort_generation(7)  # the coordinator's abort lands while the group is being built
        return built

    monkeypatch.setattr(actor_module, "new_process_group", new_group)
    assert worker._group(_Plan(7), "train", 0, 2) is built
    assert built.aborted and worker._pg is built
    assert old.aborted  # the abort also broke what was current when it came
