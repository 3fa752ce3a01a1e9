"""From Arrow rows to batches, and the loss contract: collate, vocabulary checks, weighted means."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.data import DataError
from elastic_zero.data.collate import BadRow, checked_batch, token_collate
from elastic_zero.data.source import open_source
from elastic_zero.losses import IGNORE, WEIGHT_KEY, batch_weight, checked, next_token_loss
from elastic_zero.models import build_preset
from elastic_zero.plan.batches import micro_batch_count, micro_batches, rank_positions
from elastic_zero.job.spec import DataSpec


def _rows(*lengths, start=0):
    return [[(start + i + j) % 7 for j in range(n)] for i, n in enumerate(lengths)]


def test_token_collate_pads_cuts_and_weighs_by_target_tokens():
    table = pa.table({"tokens": _rows(3, 6, 2)})
    b = token_collate(table, "tokens", seq_len=4)  # cut at 5 tokens, padded to the longest kept row
    assert b["input_ids"].shape == (3, 4) and b["targets"].shape == (3, 4)
    assert b[WEIGHT_KEY].tolist() == [2.0, 4.0, 1.0]
    rows = _rows(3, 6, 2)
    assert b["input_ids"][0].tolist() == rows[0] + [0]  # the last token has no target: harmless
    assert b["targets"][0].tolist() == rows[0][1:3] + [IGNORE, IGNORE]
    assert b["targets"][1].tolist() == rows[1][1:5]  # cut: the 6th token is no target
    fixed = token_collate(table, "tokens", seq_len=8, pad_id=5, fixed_length=True)
    assert fixed["input_ids"].shape == (3, 8) and fixed["input_ids"][2].tolist() == rows[2] + [5] * 6


def test_token_collate_names_an_empty_row_and_a_wrong_type():
    with pytest.raises(BadRow, match="holds 1 token ids") as info:
        token_collate(pa.table({"tokens": [[1, 2], [3]]}), "tokens", 4)
    assert info.value.row == 1
    with pytest.raises(ValueError, match="data.column: 'tokens' must hold lists of integer token ids"):
        token_collate(pa.table({"tokens": [[1.5, 2.0]]}), "tokens", 4)


def test_a_source_reads_the_rows_its_positions_name_and_names_bad_ones(tmp_path):
    rows = _rows(*([5] * 20))
    rows[13] = [1, 2, 99, 3]  # outside a vocabulary of 8
    rows[17] = [4]  # too short to be a sample
    pq.write_table(pa.table({"tokens": rows, "other": list(range(20))}), tmp_path / "t.parquet", row_group_size=6)
    src = open_source(DataSpec(source=str(tmp_path)), seed=1, vocab_size=8, seq_len=16, collate=None)
    good = [p for p in range(20) if src.order.samples([p])[0] not in (13, 17)]
    batch = src.batch(good[:4])
    ids = src.order.samples(good[:4])
    assert batch["input_ids"].tolist() == [rows[i][:-1] for i in ids]  # the oracle: the rows as written
    bad = next(p for p in range(20) if src.order.samples([p]) == [13])
    with pytest.raises(ValueError, match=r"data.source: .*t.parquet row 13: token id 99 in 'input_ids' is outside the model's vocabulary of 8"):
        src.batch([bad])
    short = next(p for p in range(20) if src.order.samples([p]) == [17])
    with pytest.raises(ValueError, match=r"t.parquet row 17: 'tokens' holds 1 token ids"):
        src.batch([short])
    with pytest.raises(DataError, match="data.column"):
        open_source(DataSpec(source=str(tmp_path), column="ids"), 0, 8, 16, None)


def test_a_users_collate_must_give_a_dict_of_tensors(tmp_path):
    pq.write_table(pa.table({"x": [1.0, 2.0, 3.0]}), tmp_path / "x.parquet")
    spec = DataSpec(source=str(tmp_path / "x.parquet"))
    src = open_source(spec, 0, None, None, collate=lambda t: t.column("x").to_pylist())
    with pytest.raises(ValueError, match="data.collate: must return a non-empty dict of tensors, got list"):
        src.batch([0, 1])
    src = open_source(spec, 0, None, None, collate=lambda t: {"x": torch.tensor(t.column("x").to_pylist()) / 0 + 1 / 0})
    with pytest.raises(ValueError, match="data.collate: raised ZeroDivisionError"):
        src.batch([0])
    src = open_source(spec, 0, None, None, collate=lambda t: {"x": torch.tensor(t.column("x").to_pylist())})
    assert sorted(src.batch([0, 1, 2])["x"].tolist()) == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        checked_batch({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_the_loss_contract_is_checked():
    w = torch.ones(2, requires_grad=True)
    assert checked(w.sum(), 0)[1:] == (2.0, {})
    loss, value, metrics = checked({"loss": w.sum(), "acc": torch.tensor(0.5), "n": 3}, 0)
    assert math.isnan(checked(w.sum() * math.nan, 0, finite=False)[1])  # float16: the loss scaler's to skip
    assert metrics == {"acc": 0.5, "n": 3.0} and loss.shape == () and value == 2.0
    for bad, message in ((w * 2, "must return a scalar tensor .* shape \\(2,\\)"),
                         ({"acc": 1.0}, "without 'loss'"), (3.0, "got float"),
                         (torch.tensor(1.0), "does not depend on the model"),
                         (w.sum() * math.nan, "the loss is nan at step 7"),
                         ({"loss": w.sum(), "acc": math.inf}, "metric 'acc' is inf at step 7")):
        with pytest.raises(ValueError, match="train.loss: .*" + message):
            checked(bad, 7)


def test_a_lazy_loss_stays_a_tensor_and_its_summary_is_checked_once_summed():
    """Training reads the loss back once a step, from the summed summary (on a GPU a read per micro
    batch would make the host wait for each forward): a non-finite term there fails every rank alike,
    with the same line as the eager check."""
    from elastic_zero.losses import read_step_summary, step_summary

    w = torch.ones(2, requires_grad=True)
    loss, value, metrics = checked({"loss": w.sum(), "acc": torch.tensor(0.5), "n": 3}, 0, lazy=True)
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.item() == 2.0
    assert isinstance(metrics["acc"], torch.Tensor) and metrics["n"] == 3.0
    with pytest.raises(ValueError, match="train.loss: metric 'acc' must be a scalar, got str"):
        checked({"loss": w.sum(), "acc": "high"}, 0, lazy=True)
    summed = step_summary(False, 2.0, value * 2.0, {"acc": metrics["acc"] * 2.0}, "cpu") + \
        step_summary(False, 2.0, 6.0, {"acc": 1.0}, "cpu")
    assert read_step_summary(summed, ["acc"], 2, 3, finite=True, finite_metrics=True) == (2.5, {"acc": 0.5})
    for nan_loss, nan_metric, message in ((math.nan, 0.0, "the loss is nan at step 3"),
                                          (1.0, math.inf, "metric 'acc' is inf at step 3")):
        bad = step_summary(False, 2.0, torch.tensor(nan_loss, dtype=torch.float64), {"acc": nan_metric}, "cpu")
        with pytest.raises(ValueError, match="train.loss: " + message):
            read_step_summary(bad + step_summary(False, 2.0, 1.0, {"acc": 0.0}, "cpu"), ["acc"], 2, 3, finite=True,
                              finite_metrics=True)
    # float16: a loss that is not finite is the loss scaler's to skip; a metric still must be finite
    bad = step_summary(False, 2.0, torch.tensor(math.nan, dtype=torch.float64), {"acc": 1.0}, "cpu")
    assert math.isnan(read_step_summary(bad, ["acc"], 1, 3, finite_metrics=True)[0])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(2, 9), min_size=6, max_size=12), st.integers(1, 4), st.integers(1, 3))
def test_weighted_micro_batches_give_the_global_token_mean_for_any_split(lengths, world, micro):
    """The worker's rule (losses.py): a micro batch's token-mean loss times weight * N / W, averaged
    over ranks, is the gradient of the mean over every token of the global batch (the oracle: one
    process, one batch)."""
    batch_size = len(lengths)
    if world > batch_size:
        return
    torch.manual_seed(0)
    model = build_preset("gpt-tiny", vocab_size=8, seq_len=8, n_layer=1, d_model=16)
    table = pa.table({"tokens": _rows(*lengths)})
    everything = token_collate(table, "tokens", 8)
    next_token_loss(model, everything).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = sum(batch_weight(token_collate(table.take([i]), "tokens", 8), 1) for i in range(batch_size))
    grads = []
    for r in range(world):
        positions = rank_positions(0, batch_size, world, r)
        for m in micro_batches(positions, micro_batch_count(batch_size, world, micro)):
            if not m:
                continue
            b = token_collate(table.take(list(m)), "tokens", 8)
            (next_token_loss(model, b) * (batch_weight(b, len(m)) * world / total)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    for i, g in enumerate(want):
        torch.testing.assert_close(sum(rank[i] for rank in grads) / world, g, rtol=1e-5, atol=1e-6)


def test_the_step_summary_catches_ranks_whose_losses_return_different_metrics():
    """Every rank all-reduces one fixed-size summary; metrics that differ between ranks (a loss whose
    keys depend on the data) are caught on every rank instead of mismatching the collective."""
    from elastic_zero.losses import MAX_METRICS, read_step_summary, step_summary

    ranks = [(False, 3.0, 6.0, {"acc": 1.5}), (True, 1.0, 1.0, {"acc": 0.5})]
    reduced = sum(step_summary(*r, "cpu") for r in ranks)
    assert reduced.shape == (7 + MAX_METRICS,) and reduced[0] == 1 and reduced[-2] == 0 and reduced[-1] == 0
    # the last two slots: a checkpoint asked for, a save still being written, on any rank, seen on every rank
    asked = step_summary(False, 1.0, 1.0, {}, "cpu", checkpoint_asked=True) + step_summary(False, 1.0, 1.0, {}, "cpu")
    assert asked[-2] == 1 and asked[0] == 0 and asked[-1] == 0
    busy = step_summary(False, 1.0, 1.0, {}, "cpu", save_busy=True) + step_summary(False, 1.0, 1.0, {}, "cpu")
    assert busy[-1] == 1 and busy[-2] == 0
    assert read_step_summary(reduced, ["acc"], 2, 0) == (7.0 / 4, {"acc": 0.5})
    mixed = step_summary(False, 1.0, 1.0, {"acc": 1.0}, "cpu") + step_summary(False, 1.0, 1.0, {"f1": 1.0}, "cpu")
    for names in (["acc"], ["f1"]):
        with pytest.raises(ValueError, match="train.loss: the ranks returned different metrics at step 4"):
            read_step_summary(mixed, names, 2, 4)
    with pytest.raises(ValueError, match="at most 16"):
        step_summary(False, 1.0, 1.0, {f"m{i}": 0.0 for i in range(17)}, "cpu")


def test_reading_ahead_gives_the_batches_a_direct_read_gives(tmp_path):
    """A rank reads its coming shares in one call; the batches it then serves are the ones a direct
    read of each micro batch gives (the oracle), and a change of world (other shares) reads anew."""
    from elastic_zero.data.source import read_ahead_for_step

    pq.write_table(pa.table({"tokens": _rows(*[3 + i % 9 for i in range(90)])}), tmp_path / "t.parquet",
                   row_group_size=8)
    spec = DataSpec(source=str(tmp_path / "t.parquet"))
    ahead, direct = (open_source(spec, 3, None, 16, None) for _ in range(2))
    for world, steps in ((2, range(0, 5)), (3, range(5, 9))):
        reads = None
        for step in steps:
            share = rank_positions(step, 10, world, world - 1)
            read_ahead_for_step(ahead, step, 9, lambda s, w=world: rank_positions(s, 10, w, w - 1))
            assert ahead.holds(share) and reads in (None, ahead.rows.blocks_read)  # read once, then served
            reads = ahead.rows.blocks_read
            for m in micro_batches(share, 2):
                got, want = ahead.batch(m), direct.batch(list(m))
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert not ahead.holds(rank_positions(steps[-1] + 1, 10, world + 1, 0))
