"""A checkpoint's sample records as runs (checkpoint/sample_runs.py). Oracle: the rows themselves."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_zero.checkpoint.sample_runs import decode_runs, encode_runs, manifest_rows, runs_of_logs


def _steps_of_a_generation(generation, world, global_batch, steps):
    """What a generation's ranks train on, the way rank_positions splits each step's global batch."""
    rows = []
    for step in steps:
        start = step * global_batch
        for rank in range(world):
            count = global_batch // world + (rank < global_batch % world)
            rows.append((generation, step, rank, start, count))
            start += count
    return rows


def test_a_generations_steps_are_one_run_per_rank():
    rows = _steps_of_a_generation(3, world=3, global_batch=16, steps=range(45, 170))
    runs = encode_runs(rows)
    assert runs == [(3, 0, 45, 125, 720, 6, 16), (3, 1, 45, 125, 726, 5, 16), (3, 2, 45, 125, 731, 5, 16)]
    assert sorted(decode_runs(runs)) == sorted(rows)


def test_a_gap_a_new_world_or_a_step_given_twice_breaks_or_keeps_a_run_as_the_books_would():
    rows = _steps_of_a_generation(1, 2, 8, [0, 1, 2, 5, 6]) + _steps_of_a_generation(2, 3, 8, [7, 8])
    rows.append((1, 1, 0, 999, 4))  # step 1 of rank 0 again: the first row stands
    runs = encode_runs(rows)
    assert [(g, r, first, n) for g, r, first, n, *_ in runs] == \
        [(1, 0, 0, 3), (1, 0, 5, 2), (1, 1, 0, 3), (1, 1, 5, 2), (2, 0, 7, 2), (2, 1, 7, 2), (2, 2, 7, 2)]
    assert sorted(decode_runs(runs)) == sorted(set(rows) - {(1, 1, 0, 999, 4)})


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 3), st.integers(0, 500),
                          st.integers(0, 9)), max_size=60))
def test_any_rows_come_back_from_their_runs(rows):
    first = {}
    for generation, step, rank, start, count in rows:
        first.setdefault((generation, step, rank), (generation, step, rank, start, count))
    assert sorted(decode_runs(encode_runs(rows))) == sorted(first.values())


def test_a_manifest_written_before_runs_still_gives_its_rows():
    assert manifest_rows({"sample_log": [[0, 1, 0, 8, 4]]}) == [(0, 1, 0, 8, 4)]
    assert manifest_rows({"sample_runs": [[0, 0, 1, 2, 8, 4, 8]]}) == [(0, 1, 0, 8, 4), (0, 2, 0, 16, 4)]
    assert manifest_rows({}) == []


def test_a_run_of_no_steps_is_refused():
    with pytest.raises(ValueError, match="sample run"):
        decode_runs([(0, 0, 1, 0, 8, 4, 8)])


_row = st.tuples(st.integers(0, 30), st.integers(0, 4), st.integers(0, 500), st.integers(0, 9))


@given(st.lists(st.lists(_row, max_size=40), max_size=6))
def test_logs_as_runs_give_each_ranks_rows_from_the_first_log_that_has_them(logs):
    """A generation_end event's samples (coordinator/job_record.py). Oracle: the rows, a rank's taken
    from the first log that has it."""
    owner = {}
    for i, log in enumerate(logs):
        for _, rank, _, _ in log:
            owner.setdefault(rank, i)
    want = sorted({(7, step, rank, start, count) for i, log in enumerate(logs) for step, rank, start, count in log
                   if owner[rank] == i})
    assert sorted(set(decode_runs(runs_of_logs(7, logs)))) == want


def test_a_workers_log_in_step_order_is_one_run():
    rows = [(step, 2, step * 16 + 11, 5) for step in range(45, 170)]
    assert runs_of_logs(3, [rows, rows]) == [(3, 2, 45, 125, 11 + 45 * 16, 5, 16)]


@given(st.integers(0, 4), st.integers(0, 50), st.integers(0, 12), st.integers(0, 500), st.integers(0, 9),
       st.integers(-20, 20), st.one_of(st.none(), st.tuples(st.integers(0, 11), st.integers(-2, 2), st.integers(-1, 1))),
       st.booleans())
def test_a_log_that_is_one_run_is_taken_whole_as_the_row_walk_would_give_it(rank, first, n, start, count, stride, bent,
                                                                           gap):
    """runs_of_logs' shortcut (regular_run) for a worker's log; oracle: encode_runs' row-by-row walk
    of the same rows, a row bent (its start or count moved) or the last step a step later, where
    drawn so."""
    log = [(first + i + (gap and i == n - 1), rank, start + i * stride, count) for i in range(n)]
    if bent is not None and log:
        i, start_by, count_by = bent
        step, _, start_i, count_i = log[i % n]
        log[i % n] = (step, rank, start_i + start_by, max(0, count_i + count_by))
    assert runs_of_logs(7, [log]) == encode_runs([(7, *row) for row in log])
