"""The rule that keeps a worker's generations apart (worker/generation_gate.py), over random histories.

A history: the coordinator runs generations 0..n; the worker takes part in some of them, leaves
collectives in flight at the end of some (the gathers after a last step), and each generation ends
"ended" or "abort" (the final save's loss turns an "ended" into an "abort" afterwards). The abort
reaches the worker (its end watch, or a Ray call) at any moment: before it entered that generation,
while in it, after it left it, or never. Oracle: what the coordinator said, which the worker must
obey exactly: no wait of a generation ever meets a group aborted for another, an abort is seen by
the generation it names and by no other, and an aborted generation's groups are all aborted once
the worker has left it.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.wire.generation_ends import ABORTED, ENDED, over_key
from elastic_zero.worker.generation_gate import GenerationGate
from elastic_zero.zero.abortable import GroupAborted


class _Store:
    """The job's store, as much of it as the gate reads."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def check(self, keys) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key) -> bytes:
        return self.values[key]


class _Group:
    def __init__(self, generation: int) -> None:
        self.generation, self.aborted = generation, False

    def abort(self) -> None:
        self.aborted = True


class _Work:
    def __init__(self, group: _Group) -> None:
        self.group = group

    def wait(self) -> None:
        if self.group.aborted:
            raise GroupAborted(f"a group of generation {self.group.generation} was aborted")


class _Worker:
    """What the trainer does around the gate: its engine's work in flight, its interrupt."""

    def __init__(self, store: _Store) -> None:
        self.gate, self.store = GenerationGate(), store
        self.work: list[_Work] = []
        self.interrupted = False
        self.groups_of: dict[int, list[_Group]] = {}

    def enter(self, number: int) -> None:
        self.gate.enter(number, self.store, self._settle)
        with self.gate.lock:  # its groups are built unless the generation is aborted already (groups.py)
            if not self.gate.aborted.is_set():
                self.gate.groups = {"train": _Group(number), "host": _Group(number)}
                self.groups_of[number] = list(self.gate.groups.values())

    def _settle(self, stale: bool) -> None:
        if stale:
            self.work.clear()
        self.interrupted = False

    def abort(self, number: int) -> None:
        self.gate.abort(number, self._interrupt)

    def _interrupt(self) -> None:
        self.interrupted = True

    def step(self) -> None:
        """A step of the current generation: its own collectives, waited for; one gather left in flight."""
        if self.gate.aborted.is_set():
            return
        for work in self.work:
            work.wait()  # raises GroupAborted if it belongs to an aborted group
        self.work = [_Work(self.gate.groups["train"])]


# where an abort of a generation reaches the worker, relative to the worker's own timeline
_WHEN = ["before_entry", "inside", "after_leaving", "after_next_entry", "never"]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_an_abort_reaches_the_generation_it_names_and_no_other(data):
    store = _Store()
    worker = _Worker(store)
    n = data.draw(st.integers(2, 7))
    joins = [g for g in range(n) if data.draw(st.booleans())] or [0]
    ends = {g: data.draw(st.sampled_from(["ended", "abort", "ended_then_abort"])) for g in range(n)}
    when = {g: data.draw(st.sampled_from(_WHEN)) for g in range(n) if ends[g] != "ended"}
    told: set[int] = set()  # aborts that reached the worker

    def deliver(moment: str, generations) -> None:
        for g in generations:
            if when.get(g) == moment and g not in told:
                told.add(g)
                worker.abort(g)

    for i, g in enumerate(joins):
        earlier = [x for x in range(g) if x not in joins[:i]] + joins[:i]
        # generations before g are all over: their end keys are written before g starts
        for x in range(g):
            store.values[over_key(x)] = ABORTED if ends[x] != "ended" else ENDED
        deliver("before_entry", [g])
        deliver("after_next_entry", [x for x in earlier if x < g])  # may come just before the entry too
        worker.enter(g)
        deliver("after_next_entry", earlier)
        # the rule, at entry: a generation aborted before it was entered is aborted, no other
        assert worker.gate.aborted.is_set() == (g in told)
        # no work of an aborted group survives the entry: every wait of this generation succeeds
        worker.step()
        worker.step()
        aborted_at_entry = g in told
        deliver("inside", [g])
        # an abort inside the generation interrupts its work and breaks its groups; one before its
        # entry kept it from building any
        assert worker.interrupted == (g in told and not aborted_at_entry)
        assert all(group.aborted == (g in told) for group in worker.groups_of.get(g, []))
        assert not aborted_at_entry or g not in worker.groups_of
        deliver("after_leaving", [g])
        for x in range(g):  # a late abort of an older generation changes nothing here
            if x not in told and when.get(x) in ("after_leaving", "after_next_entry"):
                told.add(x)
                worker.abort(x)
        assert worker.gate.aborted.is_set() == (g in told)
    # every generation the worker left, aborted by the coordinator, has its groups all aborted
    for g in joins[:-1]:
        if ends[g] != "ended":
            assert all(group.aborted for group in worker.groups_of.get(g, [])), f"generation {g} left open"
        else:
            assert not any(group.aborted for group in worker.groups_of.get(g, [])), f"generation {g} aborted"


def test_a_generation_is_entered_once_and_in_order():
    worker = _Worker(_Store())
    worker.enter(3)
    for number in (3, 2):
        try:
            worker.enter(number)
        except ValueError as exc:
            assert f"generation {number} entered after generation 3" in str(exc)
        else:
            raise AssertionError("entered again")
