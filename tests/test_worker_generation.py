"""A worker's generation bookkeeping without Ray: safe-point requests and aborts that race with
the start of a generation. Oracle: the generation each message names."""

import datetime
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

import elastic_zero.worker.node_duties as node_duties_module
import elastic_zero.worker.groups as groups_module
from elastic_zero.worker.entry import GenerationEntry
from elastic_zero.worker.generation_gate import GenerationGate
from elastic_zero.worker.groups import GenerationGroups
from elastic_zero.worker.node_duties import NodeDuties
from elastic_zero.worker.trainer import Trainer
from elastic_zero.zero.abortable import GroupAborted

pytestmark = pytest.mark.unit


class _Group:
    def __init__(self) -> None:
        self.was_aborted = threading.Event()

    @property
    def aborted(self) -> bool:
        return self.was_aborted.is_set()

    def abort(self) -> None:
        self.was_aborted.set()


class _Store:
    def clone(self):
        return self

    def check(self, keys) -> bool:  # no generation's end was written
        return False


class _Plan:
    def __init__(self, number: int) -> None:
        self.number = number


def _bare_worker():
    """The parts of a worker that the control calls touch (its constructor builds a model and
    connects to a store)."""
    from types import SimpleNamespace

    worker = object.__new__(Trainer)
    worker._gate = GenerationGate()
    worker._safe_point_for = -1
    worker.held = SimpleNamespace(engine=None)
    worker.writer = None
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


def _groups_in_generation(number, store=None, timeout_s=5.0):
    """A worker's groups (and the gate that aborts them) in generation `number`."""
    gate = GenerationGate()
    gate.number = number
    return GenerationGroups(store or _Store(), timeout_s, gate, lambda: None), gate


def _abort(gate, number):
    """The coordinator's abort of generation `number`, as the worker takes it."""
    gate.abort(number, lambda: None)


def test_an_abort_that_comes_while_a_group_is_built_aborts_that_group(monkeypatch):
    """Seen before: the group was made current outside the lock, so an abort that came between
    the generation's start and the group's creation aborted the previous group, and the new one
    waited for the collective timeout."""
    groups, gate = _groups_in_generation(7)
    old = gate.groups["train"] = _Group()
    built = _Group()

    def new_group(*args, **kwargs):
        _abort(gate, 7)  # the coordinator's abort lands while the group is being built
        return built

    monkeypatch.setattr(groups_module, "new_process_group", new_group)
    with pytest.raises(GroupAborted, match="aborted while its groups were being built"):
        groups.build(_Plan(7), {"train": (0, 2, "gloo")})
    assert built.aborted and old.aborted  # the abort also broke what was current when it came


def test_an_abort_gives_up_a_group_whose_members_never_come(monkeypatch):
    """Seen in the chaos drill: a new member died before it joined the train group's rendezvous;
    the survivor waited in the store for the whole timeout, was declared unresponsive and killed."""
    groups, gate = _groups_in_generation(5)
    release, built = threading.Event(), _Group()

    def new_group(*args, **kwargs):
        release.wait(30)  # the rendezvous waits for a member that is gone
        return built

    monkeypatch.setattr(groups_module, "new_process_group", new_group)
    threading.Timer(0.2, _abort, args=(gate, 5)).start()
    started = time.monotonic()
    with pytest.raises(GroupAborted):
        groups.build(_Plan(5), {"train": (1, 2, "gloo"), "host": (1, 2, "gloo")})
    assert time.monotonic() - started < 5
    release.set()  # the build finishes later: the group it made is aborted, never used
    assert built.was_aborted.wait(5)


def test_a_group_given_up_does_not_hold_the_next_one_behind_it():
    """Real gloo over a real store: generation 5's train group waits in the store for a member that
    died; after the abort, generation 6's group must build at once. Seen in the chaos drill: both
    went through one store connection, so the next build waited out the first one's timeout (30 s)."""
    from elastic_zero.wire.rendezvous import loopback_store

    server = loopback_store(10)
    store = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=10))
    groups, gate = _groups_in_generation(5, store, timeout_s=10.0)
    threading.Timer(0.3, _abort, args=(gate, 5)).start()
    with pytest.raises(GroupAborted):
        groups.build(_Plan(5), {"train": (1, 2, "gloo")})  # rank 0 never comes
    gate.number = 6
    gate.aborted.clear()
    started = time.monotonic()
    built = groups.build(_Plan(6), {"train": (0, 1, "gloo"), "host": (0, 1, "gloo")})
    assert time.monotonic() - started < 5 and built["train"].size() == 1 and built["host"].size() == 1
    # rank 0 comes after all: the build given up ends (and aborts the group it made) before the store
    # goes, or it would wait on past this test and print its failed reads into the next ones' output
    from elastic_zero.zero import new_process_group

    (given_up,) = [t for t in threading.enumerate() if t.name == "group-g5-train"]
    new_process_group(store.clone(), "g5/train/", 0, 2, "gloo", timeout_s=10.0).abort()
    given_up.join(10)
    assert not given_up.is_alive()


def test_a_worker_whose_node_is_unknown_says_so(monkeypatch):
    """Seen before: when the Ray node id could not be read every worker became node 'local', and
    buddies landed on one machine without a word."""
    duties = NodeDuties(None, "w3", None, None)
    monkeypatch.delenv("ELASTIC_ZERO_NODE", raising=False)
    monkeypatch.setattr(node_duties_module, "ray_node_id", lambda: (None, "RuntimeError: no runtime context"))
    hello = duties.hello(node_duties_module.memory_facts(None))
    assert hello.member.node == "unknown-w3"  # its own failure domain, not one shared by every such worker
    assert hello.warning == "the Ray node of w3 is unknown (RuntimeError: no runtime context)"
    assert hello.pid == os.getpid()  # the worker's process, which the coordinator logs in worker_ready


def test_a_worker_is_ready_only_once_it_beats(monkeypatch):
    """hello() returns after the worker's first heartbeat is out (its silence counts from the
    generation its readiness may start at once); a beat process that never beats is said, not hidden."""
    import subprocess
    import sys

    from elastic_zero.wire.heartbeats import beat_token, start_beat_process
    from elastic_zero.worker import node_duties

    duties = NodeDuties(None, "w3", None, None)
    monkeypatch.setenv("ELASTIC_ZERO_NODE", "n1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as coordinator:
        coordinator.bind(("127.0.0.1", 0))
        duties._beats = start_beat_process("127.0.0.1", coordinator.getsockname()[1], beat_token(b"s" * 32), "w3", 60.0)
        try:
            assert duties.hello({}).warning == ""
            coordinator.setblocking(False)
            assert coordinator.recv(512).endswith(b"w3")
            assert duties.hello({}).warning == ""  # asked again (a retried call): nothing left to wait for
        finally:
            duties._beats.kill()
            duties._beats.wait()
    monkeypatch.setattr(node_duties, "BEAT_START_TIMEOUT_S", 0.2)
    duties._beats = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert duties.hello({}).warning == "the heartbeats of w3 had not started 0.2 s after its start"
    finally:
        duties._beats.kill()
        duties._beats.wait()


def test_an_abort_that_comes_before_train_entered_its_generation_aborts_it_on_entry():
    """Ray runs a worker's calls concurrently: the coordinator's one abort of generation 7 may run
    before train(plan 7) has entered it. It must not be lost (the coordinator aborts each survivor
    once), nor reach generation 8."""
    from types import SimpleNamespace

    worker = _bare_worker()
    worker._gate.number = 6
    worker.abort_generation(7)
    assert not worker._gate.aborted.is_set()  # generation 6 goes on
    entry = _bare_entry(worker._gate)
    seen = {}
    entry._start_fresh = lambda plan, report, clock: seen.setdefault(plan.number, worker._gate.aborted.is_set())
    for number in (7, 8):
        entry.enter(SimpleNamespace(number=number, source="init", replicas=True), {})
    assert seen == {7: True, 8: False}


def _bare_entry(gate):
    """A worker's entry into generations, with what entering touches before it starts anything."""
    from types import SimpleNamespace

    return GenerationEntry(None, "w0", SimpleNamespace(engine=None), _Store(), gate, None,
                           SimpleNamespace(plan_keeps_replicas=lambda planned: None),
                           SimpleNamespace(engine_released=lambda: None), None, None, None, "gloo")


def test_entering_a_generation_gives_its_transients_back_and_then_steps_in_the_heap(monkeypatch):
    """Entering makes and drops large transients (restores, handovers, engines): they go back to
    the system; the steps after it keep their freed memory for the next step (host_memory.py)."""
    import elastic_zero.zero.host_memory as host_memory

    calls = []
    for name in ("large_allocations_to_the_system", "release_free_memory", "step_allocations_in_the_heap"):
        monkeypatch.setattr(host_memory, name, lambda name=name: calls.append(name))
    entry = _bare_entry(GenerationGate())
    entry._enter_by_source = lambda plan, report: calls.append("enter") or 0
    assert entry.enter(_Plan(3), {}) == 0
    assert calls == ["large_allocations_to_the_system", "release_free_memory", "enter", "release_free_memory",
                     "step_allocations_in_the_heap"]
