"""A Report's per-step columns as they travel (Report.__reduce__, protocol.py) and as the coordinator
holds them: a worker's sample log of consecutive steps as its one run, its step times as an array of
doubles, its losses as the first step and an array. Each is a read-only sequence equal to the tuple
it stands for, whose rows are made only when read. As tuples, a report grew with its generation's
length and cost the coordinator an object a value to load: 51 us at 100 steps, 1,024 such reports
a quarter of its time from a node's loss until the survivors held their plans; a generation of
10,000 steps would make each 0.4 MB. The books take a run whole (sample_runs.regular_run) and read
one rank's times and losses.

What does not fit a form (a log that is not one run, a column with a value that is not a float)
travels as it is."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat

from elastic_zero.checkpoint.sample_runs import regular_run

LOGS = ("log", "ward_log")
FLOATS = ("step_times", "step_ends", "protect_times")
PAIRS = ("losses",)  # (step, loss) of consecutive steps


class _Column(Sequence):
    """A read-only sequence equal (and hashing alike) to the tuple of its rows."""

    __slots__ = ()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} outside a column of {n}")
        return self._row(index % n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, _Column)):  # (a tuple is not equal to a list either)
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class StepRows(_Column):
    """A rank's (step, rank, start, count) rows of consecutive steps: (rank, first step, steps, first
    start, count, stride), as regular_run() gives them."""

    __slots__ = ("run",)

    def __init__(self, run: tuple[int, int, int, int, int, int]) -> None:
        self.run = run

    def __len__(self) -> int:
        return self.run[2]

    def __iter__(self):
        rank, first, n, start, count, stride = self.run
        return zip(range(first, first + n), repeat(rank, n), range(start, start + n * stride, stride), repeat(count, n))

    def _row(self, i: int) -> tuple[int, int, int, int]:
        rank, first, _, start, count, stride = self.run
        return first + i, rank, start + i * stride, count

    def __reduce__(self):
        return StepRows, (self.run,)


class Doubles(_Column):
    """Floats, as an array of doubles (made from the floats, or from its bytes when unpickled)."""

    __slots__ = ("values",)

    def __init__(self, data) -> None:
        self.values = array("d", data)  # (bytes go through frombytes)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)

    def _row(self, i: int) -> float:
        return self.values[i]

    def __reduce__(self):
        return Doubles, (self.values.tobytes(),)


class StepPairs(_Column):
    """(step, value) of consecutive steps from `first`, the values as an array of doubles (made from
    the floats, or from its bytes when unpickled)."""

    __slots__ = ("first", "values")

    def __init__(self, first: int, data) -> None:
        self.first, self.values = first, array("d", data)  # (bytes go through frombytes)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return zip(range(self.first, self.first + len(self.values)), self.values)

    def _row(self, i: int) -> tuple[int, float]:
        return self.first + i, self.values[i]

    def __reduce__(self):
        return StepPairs, (self.first, self.values.tobytes())


def packed(values: dict) -> dict:
    """`values` (a report's fields) with each column that fits a form in that form."""
    out = dict(values)
    for name in LOGS:
        run = None if isinstance(values[name], StepRows) else regular_run(values[name])
        if run is not None:
            out[name] = StepRows(run)
    for name in FLOATS:
        column = values[name]
        if column and not isinstance(column, Doubles) and set(map(type, column)) == {float}:
            out[name] = Doubles(column)
    for name in PAIRS:
        column = values[name]
        if len(column) > 1 and not isinstance(column, StepPairs):
            steps, numbers = zip(*column)
            if set(map(type, steps)) == {int} and steps == tuple(range(steps[0], steps[0] + len(steps))) and \
                    set(map(type, numbers)) == {float}:
                out[name] = StepPairs(steps[0], numbers)
    return out
