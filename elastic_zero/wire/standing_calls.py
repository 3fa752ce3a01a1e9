"""Standing train calls: one Ray call per worker for as many generations as it stays in, the plans
and the reports in between going through the job's store.

Why: every generation used to cost the coordinator a `train` call to each participant and a
report to collect from each (at 1,024 workers on two cores, 270-530 us of its CPU a call, and the
reports as much again: most of its share of a node's loss). Now a worker's call, when its part of
a generation ends, hands its report in (a queue in the store, one per generation) and waits for
the plan that follows (one key, written once for all of them); it returns only when that plan
leaves it out, when the coordinator is gone, or when it left in a handover.

Keys, for generation n: `g{n}/handed_in`, a queue of pickled reports (torch's queue_push: a
value per report, so nothing is copied as the queue grows); `g{n}/then`, the packed plan of the
generation that follows n (protocol.pack_plan), set once by the coordinator as it starts it.
"""

from __future__ import annotations

import datetime
import pickle

from elastic_zero.protocol import Report

HANDED_IN_POLL_S = 0.02  # how often the coordinator's loop looks for reports handed in (one exchange a look)
WAIT = datetime.timedelta(days=7)  # as good as forever: the coordinator sets the key, or goes (and the wait fails)


def handed_in_key(number: int) -> str:
    return f"g{number}/handed_in"


def then_key(number: int) -> str:
    return f"g{number}/then"


def hand_in(store, number: int, report: Report) -> None:
    """A worker's report of generation `number`, into the store for the coordinator (a worker's side)."""
    store.queue_push(handed_in_key(number), pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))


def await_plan_after(store, number: int) -> bytes | None:
    """The packed plan the coordinator set to follow generation `number`, once it is set; None where
    the store is gone (the coordinator with it) or broke. `store`: a connection of the caller's own,
    blocked while it waits (a worker's side)."""
    try:
        store.wait([then_key(number)], WAIT)
        return store.get(then_key(number))
    except (RuntimeError, OSError):  # torch's DistError (a RuntimeError): the store gone, or the wait's end
        return None


def stand_by(store, number: int, report: Report) -> bytes | None:
    """After generation `number`, in a standing call: `report` handed in, then the packed plan that
    follows, once the coordinator sets it; None where the store is gone (the coordinator with it, or
    the network between). `store`: a worker's StoreLink (worker/store_link.py), whose waiter() is a
    connection of its own for the wait. Never raises for the store: a call that raised would count
    as its worker's death."""
    try:
        hand_in(store, number, report)
    except (RuntimeError, OSError):
        return None
    return await_plan_after(store.waiter(), number)


def hand_out(store, number: int, packed_plan: bytes) -> None:
    """The plan that follows generation `number`, for every worker whose call stands after it (the
    coordinator's side)."""
    store.set(then_key(number), packed_plan)


def take_handed_in(store, number: int) -> list[Report]:
    """The reports of generation `number` handed in since the last take (the coordinator's side: a
    wire/store_client.StoreClient, which pops them all in one exchange)."""
    return [pickle.loads(data) for data in store.pop_all(handed_in_key(number))]
