"""Sample records as runs, the way a checkpoint's manifest keeps them.

A sample record is one row (generation, step, rank, start, count): the global sample positions a
rank trained on at a step. A checkpoint carries the records of every step its generation trained
(they stand for the generation's reports should every member be lost), so the rows grow with the
generation's length. Within a generation a rank's rows follow a pattern (the next step, the start
one global batch further, the same count), so they are kept as runs: (generation, rank, first
step, steps, first start, count, start stride). Pure: no torch, no files.
"""

from __future__ import annotations

from typing import Iterable

Row = tuple[int, int, int, int, int]  # generation, step, rank, start, count
Run = tuple[int, int, int, int, int, int, int]  # generation, rank, first step, steps, first start, count, stride


def encode_runs(rows: Iterable[Row]) -> list[Run]:
    """The rows as runs; a (generation, step, rank) given twice keeps its first row, as the
    coordinator's books do."""
    first_seen: dict[tuple[int, int, int], Row] = {}
    for row in rows:
        generation, step, rank, start, count = (int(v) for v in row)
        first_seen.setdefault((generation, rank, step), (generation, step, rank, start, count))
    runs: list[list[int]] = []
    for (generation, rank, step), (_, _, _, start, count) in sorted(first_seen.items()):
        last = runs[-1] if runs else None
        if last is not None and _extends(last, generation, rank, step, start, count):
            if last[3] == 1:
                last[6] = start - last[4]
            last[3] += 1
        else:
            runs.append([generation, rank, step, 1, start, count, 0])
    return [tuple(run) for run in runs]


def runs_of_logs(generation: int, logs: Iterable[Iterable[tuple[int, int, int, int]]]) -> list[Run]:
    """A generation's reports' logs, each of (step, rank, start, count) rows, as runs, in one pass and
    no sort (encode_runs sorts: 0.5 s of a coordinator's CPU for 1,024 ranks' 100 steps, twice over).
    A rank whose rows an earlier log gave is skipped in a later one (a buddy's copy of its ward's
    rows: give the ranks' own logs first). Rows in step order, as a worker appends them, make one run
    per rank; rows out of order only make more runs, each row still given once."""
    runs: list[list[int]] = []
    given: set[int] = set()  # ranks whose rows an earlier log gave
    for log in logs:
        whole = regular_run(log)
        if whole is not None:  # a worker's own log: its run at once
            if whole[0] not in given:
                runs.append([generation, *whole])
                given.add(whole[0])
            continue
        open_run: dict[int, list[int]] = {}  # rank -> its run being extended in this log
        for step, rank, start, count in log:
            if rank in given:
                continue
            run = open_run.get(rank)
            if run is not None and step == run[2] + run[3] and count == run[5] and \
                    (run[3] == 1 or start == run[4] + run[3] * run[6]):
                if run[3] == 1:
                    run[6] = start - run[4]
                run[3] += 1
                continue
            open_run[rank] = run = [generation, rank, step, 1, start, count, 0]
            runs.append(run)
        given.update(open_run)
    return [tuple(run) for run in runs]


def regular_run(log) -> tuple[int, int, int, int, int, int] | None:
    """(rank, first step, steps, first start, count, stride) of a log of (step, rank, start, count) rows
    that is one run (one rank, consecutive steps, the same count, starts a stride apart), as the
    row-by-row walk would find it; None for any other log. Checked in C: a few microseconds for a
    worker's log of 100 steps, where the walk takes 40."""
    whole = getattr(log, "run", None)  # a StepRows (report_columns.py): the run it came as
    if whole is not None:
        return whole
    n = len(log)
    if n < 2:
        return None
    steps, ranks, starts, counts = zip(*log)
    step0, rank0, start0, count0 = log[0]
    if {*map(type, steps), *map(type, ranks), *map(type, starts), *map(type, counts)} != {int}:
        return None  # ints only: a run gives its rows back as ints
    stride = starts[1] - starts[0]
    if stride == 0 or ranks.count(rank0) != n or counts.count(count0) != n or \
            steps != tuple(range(step0, step0 + n)) or starts != tuple(range(start0, start0 + n * stride, stride)):
        return None
    return rank0, step0, n, start0, count0, stride


def _extends(run: list[int], generation: int, rank: int, step: int, start: int, count: int) -> bool:
    gen, r, first_step, steps, first_start, run_count, stride = run
    if (gen, r) != (generation, rank) or step != first_step + steps or count != run_count:
        return False
    if steps == 1:  # the second row sets the stride
        return True
    return start == first_start + steps * stride


def decode_runs(runs: Iterable[Run]) -> list[Row]:
    """Every row the runs stand for, in (generation, rank, step) order."""
    rows = []
    for run in runs:
        generation, rank, first_step, steps, first_start, count, stride = (int(v) for v in run)
        if steps < 1 or count < 0:
            raise ValueError(f"sample run {list(run)}: steps must be at least 1 and count at least 0")
        rows.extend((generation, first_step + i, rank, first_start + i * stride, count) for i in range(steps))
    return rows


def manifest_rows(extra: dict) -> list[Row]:
    """The sample records a checkpoint's manifest holds (`extra`): its runs, or the rows of a
    checkpoint written before runs."""
    return decode_runs(extra.get("sample_runs", ())) + [tuple(row) for row in extra.get("sample_log", ())]
