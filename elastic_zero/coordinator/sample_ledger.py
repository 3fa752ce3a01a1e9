"""Which global sample positions each step trained, as the coordinator's books keep them: for each
step, the generation whose records of it stand and those records, with the counts the job's summary
gives (samples once, duplicates, gaps).

A step's records are its ranks' (start, count) rows, and a generation's ranks take the same shares of
every step's block of positions (plan/batches.py: step * global_batch onward). So a step keeps its
generation and a pattern, (rank, start - step * global_batch, count) for each rank, shared by every
step with the same one: the ledger grows with the steps and the distinct patterns, not with
steps x ranks (1,024 ranks over 100,000 steps were 10^8 rows: tens of GB in a dict of dicts). The
summary counts each pattern once; where any record lies outside its step's block (a bug the counts
must still show) it counts the whole ledger position by position, as the books did before."""

from __future__ import annotations

from typing import Iterable, Sequence

from elastic_zero.checkpoint.sample_runs import regular_run

Pattern = frozenset  # {(rank, (offset in the step's block, count)), ...}


class SampleLedger:
    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self._steps: dict[int, tuple[int, Pattern]] = {}  # step -> (generation, pattern)
        self._patterns: dict[Pattern, Pattern] = {}  # each pattern once, shared by its steps

    def add(self, generation: int, logs: Iterable[Sequence[tuple[int, int, int, int]]]) -> None:
        """`generation`'s logs of (step, rank, start, count) rows, in the order given. A later
        generation's records of a step replace an earlier one's, an earlier one's are ignored, and the
        same generation's add up, rank by rank, the first record of a rank standing."""
        segments = [seg for log in logs for seg in _segments(log, self.global_batch)]
        merged: dict[tuple[Pattern, Pattern], Pattern] = {}
        for first, end, pattern in _patterns_by_steps(segments):
            pattern = self._shared(pattern)
            for step in range(first, end):
                kept = self._steps.get(step)
                if kept is None or kept[0] < generation:
                    self._steps[step] = (generation, pattern)
                elif kept[0] == generation and kept[1] is not pattern:
                    both = merged.get((kept[1], pattern))
                    if both is None:  # what stood first stays
                        both = merged[(kept[1], pattern)] = self._shared(frozenset({**dict(pattern),
                                                                                   **dict(kept[1])}.items()))
                    self._steps[step] = (generation, both)

    def add_rows(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """(generation, step, rank, start, count) rows of any generations, as add() takes them."""
        # a log per generation and rank, each in the order given (a rank's first record stands): a rank's
        # rows of consecutive steps are one run, as a report's are, not a segment a row
        by_generation: dict[int, dict[int, list]] = {}
        for generation, step, rank, start, count in rows:
            by_generation.setdefault(generation, {}).setdefault(rank, []).append((step, rank, start, count))
        for generation, by_rank in by_generation.items():
            self.add(generation, list(by_rank.values()))

    def _shared(self, pattern: Pattern) -> Pattern:
        return self._patterns.setdefault(pattern, pattern)

    def __len__(self) -> int:
        """The steps recorded."""
        return len(self._steps)

    def first_step(self) -> int | None:
        return min(self._steps) if self._steps else None

    def last_step(self) -> int | None:
        return max(self._steps) if self._steps else None

    def patterns(self) -> int:
        """The distinct patterns kept (a steady generation's steps share one)."""
        return len(self._patterns)

    def counts(self, first: int, end: int) -> dict:
        """Over the records that stand: the distinct positions trained, those trained more than once
        (each extra time), and those of steps [first, end) never trained."""
        shapes: dict[Pattern, tuple[int, int, bool]] = {}
        records = distinct = expected_covered = 0
        for step, (_, pattern) in self._steps.items():
            shape = shapes.get(pattern)
            if shape is None:
                shapes[pattern] = shape = _shape(pattern, self.global_batch)
            total, union, inside = shape
            if not inside:
                return self._counted_position_by_position(first, end)
            records += total
            distinct += union
            if first <= step < end:  # a whole block: every position of it is expected
                expected_covered += union
        return {"samples_consumed": distinct, "duplicate_samples": records - distinct,
                "skipped_samples": max(0, end - first) * self.global_batch - expected_covered}

    def _counted_position_by_position(self, first: int, end: int) -> dict:
        """counts() where some record leaves its step's block, so that blocks may overlap."""
        positions = [self.global_batch * step + offset + i for step, (_, pattern) in self._steps.items()
                     for _, (offset, count) in pattern for i in range(count)]
        seen = set(positions)
        expected = range(first * self.global_batch, end * self.global_batch)
        return {"samples_consumed": len(seen), "duplicate_samples": len(positions) - len(seen),
                "skipped_samples": sum(1 for p in expected if p not in seen)}


def _shape(pattern: Pattern, global_batch: int) -> tuple[int, int, bool]:
    """(positions recorded, distinct positions, whether all lie in the step's own block) of a pattern."""
    total = union = 0
    reach = None  # the end of the union so far, the intervals taken by their starts
    for offset, count in sorted(shares for _, shares in pattern):
        if count <= 0:
            continue
        total += count
        if offset < 0 or offset + count > global_batch:
            return total, 0, False
        start = offset if reach is None else max(offset, reach)
        union += max(0, offset + count - start)
        reach = offset + count if reach is None else max(reach, offset + count)
    return total, union, True


def _segments(log: Sequence, global_batch: int) -> list[tuple[int, int, int, int, int]]:
    """A log's rows as (rank, offset, count, first step, end step) segments, in order: one for a rank's
    rows of consecutive steps at the same share (a worker's log of a generation), else one a row."""
    run = regular_run(log)
    if run is not None and run[5] == global_batch:
        rank, first, steps, start, count, _ = run
        return [(rank, start - first * global_batch, count, first, first + steps)]
    return [(rank, start - step * global_batch, count, step, step + 1) for step, rank, start, count in log]


def _patterns_by_steps(segments: list) -> list[tuple[int, int, Pattern]]:
    """(first step, end step, pattern) for each run of steps the same segments cover, a rank's first
    segment standing over its later ones."""
    edges: dict[int, list[tuple[int, int]]] = {}  # step -> (+1 begins / -1 ends, segment index)
    for i, (_, _, _, first, end) in enumerate(segments):
        edges.setdefault(first, []).append((1, i))
        edges.setdefault(end, []).append((-1, i))
    active: set[int] = set()
    out = []
    steps = sorted(edges)
    for step, following in zip(steps, steps[1:]):
        for sign, i in edges[step]:
            (active.add if sign > 0 else active.discard)(i)
        if active:
            shares: dict[int, tuple[int, int]] = {}
            for i in sorted(active):
                rank, offset, count = segments[i][:3]
                if rank not in shares:
                    shares[rank] = (offset, count)
            out.append((step, following, frozenset(shares.items())))
    return out
