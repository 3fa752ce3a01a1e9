"""The books' sample ledger (coordinator/sample_ledger.py). Oracle: the ledger it replaced, a dict of
every step's every rank's record, kept row by row, and its counts taken position by position."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.coordinator.sample_ledger import SampleLedger
from elastic_zero.plan.batches import rank_positions

pytestmark = pytest.mark.unit


def _oracle(global_batch: int, rows, first: int, end: int) -> dict:
    """Row by row: a later generation's record of a step replaces an earlier one's, the same
    generation's add up, a rank's first record standing; then every position counted."""
    step_log: dict = {}
    for generation, step, rank, start, count in rows:
        gen, entries = step_log.get(step, (-1, {}))
        if generation > gen:
            step_log[step] = (generation, {rank: (start, count)})
        elif generation == gen:
            entries.setdefault(rank, (start, count))
    positions = [p for _, entries in step_log.values() for start, count in entries.values()
                 for p in range(start, start + count)]
    distinct = set(positions)
    expected = set(range(first * global_batch, end * global_batch))
    return {"steps": len(step_log), "first": min(step_log) if step_log else None,
            "samples_consumed": len(distinct), "duplicate_samples": len(positions) - len(distinct),
            "skipped_samples": len(expected - distinct)}


def _logs(global_batch: int):
    """Logs of (step, rank, start, count) rows, each with its generation: a rank's consecutive steps at
    its share (a worker's log), some with a row shifted (into another step's block or off the start
    of its own) or empty; and rows of any steps and ranks."""
    def log(drawn):
        generation, world, rank, first, n, odd, shift, count = drawn
        rank = min(rank, world - 1)
        rows = [(s, rank, rank_positions(s, global_batch, world, rank).start,
                 len(rank_positions(s, global_batch, world, rank))) for s in range(first, first + n)]
        if odd is not None and rows:
            step, rank_, start, count_ = rows[odd % len(rows)]
            rows[odd % len(rows)] = (step, rank_, start + shift, count_ if count is None else count)
        return generation, rows

    return st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(0, 2), st.integers(0, 5),
                              st.integers(0, 4), st.one_of(st.none(), st.integers(0, 4)),
                              st.sampled_from([0, 1, -1, global_batch, -global_batch]),
                              st.sampled_from([None, 0, 1])).map(log), max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_ledger_counts_as_the_row_by_row_books_did(data):
    global_batch = data.draw(st.integers(3, 9))
    logs = data.draw(_logs(global_batch))
    first, end = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 7))
    ledger, fed = SampleLedger(global_batch), []
    # fed as the books feed it: some rows of several generations at once (checkpoints', an earlier
    # coordinator's), then each generation's logs together (its reports), generations in any order
    cut = data.draw(st.integers(0, len(logs)))
    mixed = [(g, *row) for g, rows in logs[:cut] for row in rows]
    ledger.add_rows(mixed)
    fed += mixed
    for generation in data.draw(st.permutations(sorted({g for g, _ in logs[cut:]}))):
        of_it = [rows for g, rows in logs[cut:] if g == generation]
        ledger.add(generation, of_it)
        fed += [(generation, *row) for rows in of_it for row in rows]
    expected = _oracle(global_batch, fed, first, end)
    assert ledger.counts(first, end) == {k: expected[k] for k in ("samples_consumed", "duplicate_samples",
                                                                  "skipped_samples")}
    assert (len(ledger), ledger.first_step()) == (expected["steps"], expected["first"])


def test_a_steady_generations_steps_share_one_pattern():
    """1,024 ranks over 300 steps: one pattern kept, not 307,200 records; every sample once."""
    ledger, world, batch = SampleLedger(2048), 1024, 2048
    ledger.add(0, [[(s, r, rank_positions(s, batch, world, r).start, len(rank_positions(s, batch, world, r)))
                    for s in range(300)] for r in range(world)])
    assert ledger.patterns() == 1 and len(ledger) == 300
    assert ledger.counts(0, 300) == {"samples_consumed": 300 * batch, "duplicate_samples": 0, "skipped_samples": 0}
    # a later generation of 1,016 ranks trains steps 200-299 again: those steps are its, whole
    ledger.add(1, [[(s, r, rank_positions(s, batch, 1016, r).start, len(rank_positions(s, batch, 1016, r)))
                    for s in range(200, 300)] for r in range(1016)])
    assert ledger.patterns() == 2
    assert ledger.counts(0, 310) == {"samples_consumed": 300 * batch, "duplicate_samples": 0,
                                     "skipped_samples": 10 * batch}
