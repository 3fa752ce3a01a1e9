"""A simulated host's one read of each plan set to follow a generation (wire/standing_calls.py): its
members' standing calls wait here, as each real worker waits on a store connection of its own (one
read per host, as one watch per host reads the generations' ends: generation_ends.py)."""

from __future__ import annotations

import threading
from typing import Callable

from elastic_zero.wire.standing_calls import await_plan_after


class PlansAfter:
    def __init__(self, connect: Callable[[], object]) -> None:
        """`connect()`: a new store connection, for each generation's read (its wait blocks it)."""
        self._connect = connect
        self._arrived = threading.Condition()
        self._reading: set[int] = set()
        self._plans: dict[int, bytes] = {}  # generation -> the packed plan set to follow it

    def wait(self, number: int, gone: Callable[[], bool]) -> bytes | None:
        """The packed plan set to follow generation `number`, once it is set; None once `gone()` (the
        member was killed or its node frozen: checked whenever wake() is called, and every second)."""
        with self._arrived:
            if number not in self._reading:
                self._reading.add(number)
                threading.Thread(target=self._read, args=(number,), daemon=True, name=f"plan-after-{number}").start()
            while number not in self._plans:
                if gone():
                    return None
                self._arrived.wait(1.0)
            return self._plans[number]

    def wake(self) -> None:
        """A member's state changed (killed, frozen): its wait looks again."""
        with self._arrived:
            self._arrived.notify_all()

    def _read(self, number: int) -> None:
        packed = await_plan_after(self._connect(), number)
        if packed is None:
            return  # the store is gone: the bench is over
        with self._arrived:
            self._plans[number] = packed
            self._arrived.notify_all()
