"""A Report's per-step columns over the wire (report_columns.py). Oracle: the report as the worker
made it, of tuples; and the books fed with it."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray import cloudpickle

from elastic_zero.coordinator.books import Books
from elastic_zero.protocol import Outcome, OutcomeKind, Report
from elastic_zero.report_columns import Doubles, StepPairs, StepRows

pytestmark = pytest.mark.unit

_floats = st.floats(allow_nan=False, width=64)


@st.composite
def _reports(draw):
    rank, first, n = draw(st.integers(0, 7)), draw(st.integers(0, 1000)), draw(st.integers(0, 30))
    stride, count = draw(st.sampled_from([16, 16, 16, 7, -3])), draw(st.integers(0, 4))
    log = [(first + i, rank, first * 16 + i * stride, count) for i in range(n)]
    if log and draw(st.booleans()):  # not one run: a row bent
        i = draw(st.integers(0, n - 1))
        log[i] = (log[i][0], rank, log[i][2] + 1, count)
    times = draw(st.lists(_floats, min_size=n, max_size=n))
    if times and draw(st.integers(0, 4)) == 0:  # a value that is not a float travels as it is
        times[0] = 1
    losses = [(first + i, v) for i, v in enumerate(draw(st.lists(_floats, min_size=n, max_size=n)))]
    if len(losses) > 2 and draw(st.booleans()):  # steps not consecutive
        losses[1] = (losses[1][0] + 5, losses[1][1])
    return Report(Outcome(f"w{rank}", OutcomeKind.FINISHED, first + n), ended_at=1.5, generation=3, rank=rank,
                  log=tuple(log), ward_log=tuple(log[: n // 2]), step_times=tuple(times),
                  step_ends=tuple(float(first + i) for i in range(n)), protect_times=tuple(times[::-1]),
                  losses=tuple(losses))


@settings(max_examples=200, deadline=None)
@given(_reports())
def test_a_report_comes_back_equal_field_by_field_row_by_row(report):
    back = pickle.loads(cloudpickle.dumps(report))
    assert back == report and hash(back.log) == hash(report.log)
    for name in ("log", "ward_log", "step_times", "step_ends", "protect_times", "losses"):
        column, sent = getattr(back, name), getattr(report, name)
        assert repr(list(column)) == repr(list(sent)) and len(column) == len(sent) and column == sent, name  # (1 is not 1.0)
        assert [column[i] for i in range(-len(sent), len(sent))] == list(sent[-len(sent):] + sent), name
        assert column[1:3] == sent[1:3], name
        with pytest.raises(IndexError):
            column[len(sent)]
        assert pickle.loads(pickle.dumps(column)) == sent, name  # sent on again


def test_a_workers_columns_travel_in_their_forms_and_the_books_count_them_as_tuples():
    """1,024 ranks' reports of 100 steps: the same books from the reports as sent and as received."""
    reports = [Report(Outcome(f"w{r}", OutcomeKind.SAFE_POINT, 100), ended_at=1.0, generation=0, rank=r,
                      log=tuple((s, r, s * 2048 + 2 * r, 2) for s in range(100)), step_times=(0.25,) * 100,
                      step_ends=tuple(10.0 + s for s in range(100)), protect_times=(0.01,) * 100,
                      losses=tuple((s, 5.0 - s / 100) for s in range(100))) for r in range(1024)]
    received = [pickle.loads(cloudpickle.dumps(r)) for r in reports]
    assert isinstance(received[5].log, StepRows) and received[5].log.run == (5, 0, 100, 10, 2, 2048)
    assert isinstance(received[5].step_times, Doubles) and isinstance(received[5].losses, StepPairs)
    summaries = []
    for of_them in (reports, received):
        books = Books(global_batch=2048, steps=100, started_at=0.0)
        books.add_generation_results(0, of_them)
        summaries.append(books.summary(None))
    assert summaries[0] == summaries[1]
    assert (summaries[1]["samples_consumed"], summaries[1]["duplicate_samples"], summaries[1]["steps"]) == \
        (204800, 0, 100)


def test_a_column_with_a_value_of_another_type_anywhere_travels_as_it_is():
    """A float among a log's ints or a losses' steps (not what a worker sends, but a run would give
    it back as an int): the column comes back as sent, types and all; a list is not the tuple."""
    log = tuple((s, 0, s * 8, 8) for s in range(5)) + ((5, 0, 40, 8.0),)
    losses = tuple((s, 1.0) for s in range(4)) + ((4.0, 1.0),)
    back = pickle.loads(cloudpickle.dumps(Report(Outcome("w0", OutcomeKind.FINISHED, 6), ended_at=1.0, log=log,
                                                 losses=losses)))
    assert repr(back.log) == repr(log) and repr(back.losses) == repr(losses)
    rows = pickle.loads(cloudpickle.dumps(Report(Outcome("w0", OutcomeKind.FINISHED, 6), ended_at=1.0,
                                                 log=log[:5]))).log
    assert isinstance(rows, StepRows) and rows == log[:5] and rows != list(log[:5])
