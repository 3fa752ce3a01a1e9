"""[eval]'s pure parts (plan/evaluation.py) and its spec: when a job evaluates, how the eval set is
split over the ranks (every sample once, whatever the world size), and the one-line refusals."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_zero.job.spec import SpecError, spec_from_dict
from elastic_zero.plan.evaluation import eval_due, eval_micro_batches, eval_shares, eval_size

pytestmark = pytest.mark.unit


def test_a_job_evaluates_the_weights_it_starts_from_every_few_steps_and_its_last():
    assert [s for s in range(0, 26) if eval_due(s, 10, 25)] == [0, 10, 20, 25]
    assert [s for s in range(0, 21) if eval_due(s, 10, 20)] == [0, 10, 20]  # the last is a multiple: once
    with pytest.raises(ValueError, match="every must be >= 1"):
        eval_due(3, 0, 10)


def test_the_eval_set_is_whole_batches_at_most_the_dataset():
    assert eval_size(3, 16, None) == 48  # synthetic: no end
    assert eval_size(3, 16, 40) == 40  # at most the whole set
    assert eval_size(None, 16, 40) == 40  # the whole set
    with pytest.raises(ValueError, match="eval.batches: is required"):
        eval_size(None, 16, None)


@given(size=st.integers(1, 500), world=st.integers(1, 40), micro=st.integers(1, 9))
def test_every_sample_is_evaluated_once_and_every_rank_runs_as_many_micro_batches(size, world, micro):
    shares = eval_shares(size, world)
    assert [p for share in shares for p in share] == list(range(size))  # contiguous, in order, once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    pieces = [eval_micro_batches(size, world, rank, micro) for rank in range(world)]
    assert len({len(p) for p in pieces}) == 1  # the same number of forwards (collectives) on every rank
    for rank, share in enumerate(shares):
        assert [p for piece in pieces[rank] for p in piece] == list(share)
        assert all(len(piece) <= micro for piece in pieces[rank])


@pytest.mark.parametrize("section, message", [
    ({"source": "synthetic", "every": 0, "batches": 2}, "eval.every: must be >= 1, got 0"),
    ({"source": "synthetic"}, "eval.batches: is required for synthetic data"),
    ({"source": "synthetic", "batches": 0}, "eval.batches: must be >= 1, got 0"),
    ({"source": ""}, "eval.source: must be 'synthetic' or a path"),
    ({"source": "synthetic", "batches": 1, "loss": "no-colon"}, "eval.loss: must look like 'package.module:function'"),
    ({"sorce": "synthetic"}, "eval.sorce: unknown field; allowed: source, every, batches, loss"),
])
def test_a_wrong_eval_section_is_one_line_naming_the_field(section, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(".", r"\.")):
        spec_from_dict({"eval": section})


def test_a_kill_in_eval_drill_that_could_never_fire_is_refused():
    kill = {"at_step": 12, "action": "kill_in_eval", "rank": 1}
    with pytest.raises(SpecError, match=r"^faults\[0\]\.action: 'kill_in_eval' needs an \[eval\] section"):
        spec_from_dict({"faults": [kill]})
    with pytest.raises(SpecError, match=r"^faults\[0\]\.at_step: .*multiple of eval\.every \(10\), got 12"):
        spec_from_dict({"eval": {"source": "synthetic", "batches": 1, "every": 10}, "faults": [kill]})
    spec_from_dict({"eval": {"source": "synthetic", "batches": 1, "every": 6}, "faults": [kill]})


def test_an_eval_set_without_the_column_the_training_data_reads_is_named_before_anything_starts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_zero.job.preflight import preflight

    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 8}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"text": ["abc"] * 8}), tmp_path / "eval.parquet")
    spec = spec_from_dict({"data": {"source": str(tmp_path / "train.parquet")},
                           "eval": {"source": str(tmp_path / "eval.parquet")}})
    with pytest.raises(SpecError, match=r"^eval\.source: .*'tokens' is not a column of .*eval\.parquet.*it has: text"):
        preflight(spec, import_user_code=False)
    missing = spec_from_dict({"eval": {"source": str(tmp_path / "nope.parquet")}})
    with pytest.raises(SpecError, match=r"^eval\.source: no such file or directory"):
        preflight(missing, import_user_code=False)
