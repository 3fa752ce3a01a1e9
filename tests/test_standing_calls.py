"""Standing train calls' store protocol (wire/standing_calls.py): the reports workers hand in through
the job's store come out at the coordinator, each once, in order, as they were; the plan set after a
generation reaches every worker waiting for it; a wait ends when the store goes. Oracles: the
reports as sent (equal field by field), torch's own TCPStore clients on the worker's side."""

import threading

import pytest

from elastic_zero.protocol import Outcome, OutcomeKind, Report
from elastic_zero.wire.rendezvous import RendezvousServer, connect, new_secret
from elastic_zero.wire.standing_calls import await_plan_after, hand_in, hand_out, take_handed_in

pytestmark = pytest.mark.unit


def _report(actor_id: str, generation: int, steps: int) -> Report:
    log = tuple((s, 0, s * 4, 4) for s in range(steps))
    return Report(Outcome(actor_id, OutcomeKind.SAFE_POINT, steps, own_steps=(steps,), ward_steps=(steps,)),
                  ended_at=1.5, generation=generation, rank=0, log=log, step_times=(0.25,) * steps,
                  losses=tuple((s, 1.0 / (s + 1)) for s in range(steps)))


SECRET = new_secret()


def _through(*workers) -> None:
    """A push has no answer: a question after it on the same connection is answered once it is in."""
    for worker in workers:
        worker.check(["anything"])


@pytest.fixture
def server():
    server = RendezvousServer("127.0.0.1", SECRET, 10)
    yield server
    server.close()


def test_reports_handed_in_come_out_once_each_in_order_and_equal(server):
    workers = [connect("127.0.0.1", server.port, SECRET, 10) for _ in range(3)]
    assert take_handed_in(server.store, 4) == []  # none yet: nothing made
    sent = [_report(f"w{i}", 4, 3 + i) for i in range(3)]
    for worker, report in zip(workers, sent[:2]):
        hand_in(worker, 4, report)
    hand_in(workers[0], 5, _report("w0", 5, 1))  # another generation's queue
    _through(*workers)
    assert take_handed_in(server.store, 4) == sent[:2]
    assert take_handed_in(server.store, 4) == []  # each once
    hand_in(workers[2], 4, sent[2])
    _through(workers[2])
    (late,) = take_handed_in(server.store, 4)
    assert late == sent[2] and list(late.log) == list(sent[2].log) and list(late.losses) == list(sent[2].losses)
    assert [r.outcome.actor_id for r in take_handed_in(server.store, 5)] == ["w0"]


def test_a_thousand_reports_come_out_in_one_take(server):
    worker = connect("127.0.0.1", server.port, SECRET, 10)
    sent = [_report(f"w{i}", 1, 2) for i in range(1000)]
    for report in sent:
        hand_in(worker, 1, report)
    _through(worker)
    assert take_handed_in(server.store, 1) == sent


def test_the_plan_set_after_a_generation_reaches_every_waiting_worker_and_a_wait_ends_with_the_store(server):
    got = {}

    def wait(name: str, number: int) -> None:
        got[name] = await_plan_after(connect("127.0.0.1", server.port, SECRET, 10), number)

    threads = [threading.Thread(target=wait, args=(f"w{i}", 7)) for i in range(3)]
    threads.append(threading.Thread(target=wait, args=("other", 8)))  # waits after another generation
    for t in threads:
        t.start()
    hand_out(server.store, 7, b"the packed plan of generation 8")
    for t in threads[:3]:
        t.join(10)
    assert got == {f"w{i}": b"the packed plan of generation 8" for i in range(3)}
    assert await_plan_after(connect("127.0.0.1", server.port, SECRET, 10), 7) == got["w0"]  # set once, read late
    server.close()  # the coordinator is gone, its relay with it: the last wait ends, with no plan
    threads[3].join(20)
    assert not threads[3].is_alive() and got["other"] is None


class _Call:
    """A train call in flight as the coordinator holds it: what ray.get gives once it ended."""

    def __init__(self, actor_id: str, stand: bool) -> None:
        self.actor_id, self.stand = actor_id, stand
        self.answer = None  # a Report, or an exception (the actor died)


def _plan(number: int, participants, previous=None):
    from elastic_zero.plan.membership import Generation, Member
    from elastic_zero.protocol import GenerationPlan, Source

    members = tuple(Member(a, node=f"n{i}") for i, a in enumerate(participants))
    generation = Generation(number, members, tuple((i + 1) % len(members) for i in range(len(members))))
    return GenerationPlan(generation, previous, tuple(participants), tuple(range(len(participants))),
                          Source.INIT if previous is None else Source.LIVE, 0, (), "test")


@pytest.fixture
def generations(server, monkeypatch):
    """The coordinator's Generations over a real store, its pool a set of recorded calls."""
    from types import SimpleNamespace

    from elastic_zero.coordinator import generation_run
    from elastic_zero.coordinator.generations import Generations

    def get(call):
        if isinstance(call.answer, Exception):
            raise call.answer
        return call.answer

    monkeypatch.setattr(generation_run, "ray", SimpleNamespace(get=get, exceptions=generation_run.ray.exceptions))
    calls = []

    def handle(actor_id):
        def remote(packed, stand):
            calls.append(_Call(actor_id, stand))
            return calls[-1]
        return SimpleNamespace(train=SimpleNamespace(remote=remote))

    record = SimpleNamespace(generation_starts=lambda *args: None, log=lambda *a, **k: None,
                             generation_ended=lambda plan, results: ())
    watch = SimpleNamespace(listen_to=lambda participants: None)
    g = Generations(SimpleNamespace(faults=(), checkpoint=SimpleNamespace(resume=None)),
                    SimpleNamespace(handle=handle), watch, record, server.store,
                    SimpleNamespace(watch=lambda ref: None))
    g.calls = calls
    return g


def test_a_generation_reaches_standing_calls_through_the_store_and_calls_only_new_workers(server, generations):
    import ray

    from elastic_zero.protocol import unpack_plan

    worker = connect("127.0.0.1", server.port, SECRET, 10)
    first = _plan(0, ["w0", "w1", "w2"])
    generations.start(first)
    assert [(c.actor_id, c.stand) for c in generations.calls] == [("w0", True), ("w1", True), ("w2", True)]
    run = generations.running
    for actor_id in ("w0", "w1"):
        hand_in(worker, 0, _report(actor_id, 0, 5))
    _through(worker)
    assert [a for a, _ in generations.take_handed_in(float("inf"))] == ["w0", "w1"] and sorted(run.training()) == ["w2"]
    w2 = generations.calls[2]
    w2.answer = ray.exceptions.RayActorError()  # w2 died: its call failed
    assert run.collect(w2)[1].outcome.kind == OutcomeKind.DEAD and run.over()
    generations.end()

    # the recovery: w0 and w1 stand; w3 is new; the plan is set once, after generation 0
    second = _plan(1, ["w0", "w1", "w3"], previous=first.generation)
    generations.start(second)
    assert [c.actor_id for c in generations.calls[3:]] == ["w3"]
    assert server.store.check(["g0/then"])
    assert unpack_plan(await_plan_after(connect("127.0.0.1", server.port, SECRET, 10), 0)) == second
    run = generations.running
    assert run.owns(generations.calls[0]) and run.owns(generations.calls[1])
    assert sorted(run.training()) == ["w0", "w1", "w3"]
    # w1's call ended before it read the plan (its store broke): its answer is its report of generation 0
    generations.calls[1].answer = _report("w1", 0, 5)
    _, report, death = run.collect(generations.calls[1])
    assert death is None and report.outcome.kind == OutcomeKind.FAILED and report.generation == 1
    assert "its last generation was 0, not 1" in report.outcome.error
    hand_in(worker, 1, _report("w0", 1, 2))
    _through(worker)
    assert [a for a, _ in generations.take_handed_in(float("inf"))] == ["w0"]
    # w0's call ends after its report came through the store (it died between generations): nothing more to collect
    generations.calls[0].answer = ray.exceptions.RayActorError()
    assert run.collect(generations.calls[0]) is None
    hand_in(worker, 1, _report("w3", 1, 2))
    _through(worker)
    generations.take_handed_in(float("inf"))
    assert run.over()
    generations.end()
    # only w3's call stands after generation 1: w0's ended, w1's failed
    third = _plan(2, ["w1", "w3"], previous=second.generation)
    generations.start(third)
    assert [c.actor_id for c in generations.calls[4:]] == ["w1"]
    assert generations.running.owns(generations.calls[3])


def test_a_call_that_ends_between_generations_no_longer_stands(server, generations):
    worker = connect("127.0.0.1", server.port, SECRET, 10)
    generations.start(_plan(0, ["w0", "w1"]))
    for actor_id in ("w0", "w1"):
        hand_in(worker, 0, _report(actor_id, 0, 3))
    _through(worker)
    generations.take_handed_in(float("inf"))
    generations.end()
    assert generations.collect(generations.calls[0]) is None  # w0's call ended (killed, retired) before the next plan
    generations.start(_plan(1, ["w0", "w1"], previous=_plan(0, ["w0", "w1"]).generation))
    assert [c.actor_id for c in generations.calls[2:]] == ["w0"]  # a new call for w0 only
