import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_zero.data import GlobalOrder
from elastic_zero.data.source import open_source
from elastic_zero.plan.batches import loss_weight, micro_batch_count, micro_batches, rank_positions, rank_shares


@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 50))
def test_every_position_of_a_step_goes_to_exactly_one_rank(batch, world, step):
    if batch < world:
        with pytest.raises(ValueError, match="cannot be split"):
            rank_shares(batch, world)
        return
    shares = rank_shares(batch, world)
    assert sum(shares) == batch and max(shares) - min(shares) <= 1
    seen = [p for r in range(world) for p in rank_positions(step, batch, world, r)]
    assert seen == list(range(step * batch, (step + 1) * batch))
    count = micro_batch_count(batch, world, 3)
    weights = sum(loss_weight(len(m), batch, world) for r in range(world)
                  for m in micro_batches(rank_positions(step, batch, world, r), count))
    assert weights == pytest.approx(world)  # averaged over ranks: weight 1 in all


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 9), st.integers(0, 50))
def test_every_rank_runs_the_same_number_of_micro_batches(batch, world, micro, step):
    """Each micro batch runs the engine's collectives: unequal counts deadlock or crash the ranks
    (seen: global_batch 9, micro_batch 4, 2 ranks, stage 2 took 2 and 1 micro batches)."""
    if batch < world:
        return
    count = micro_batch_count(batch, world, micro)
    for r in range(world):
        positions = rank_positions(step, batch, world, r)
        pieces = micro_batches(positions, count)
        assert len(pieces) == count and all(len(p) <= micro for p in pieces)
        assert [p for piece in pieces for p in piece] == list(positions)
    assert count == -(-max(rank_shares(batch, world)) // micro)  # no more than the largest share needs


def test_weighted_uneven_shares_give_the_global_mean_gradient():
    """16 samples over 3 ranks (6, 5, 5): the rank-averaged weighted gradients equal the global mean."""
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(16, 4)
    (x @ w).square().mean().backward()
    want, w.grad = w.grad.clone(), None
    grads = []
    for r in range(3):
        pos = rank_positions(0, 16, 3, r)
        for m in micro_batches(pos, micro_batch_count(16, 3, 4)):
            ((x[list(m)] @ w).square().mean() * loss_weight(len(m), 16, 3)).backward()
        grads.append(w.grad.clone())
        w.grad = None
    torch.testing.assert_close(sum(grads) / 3, want)


def test_global_order_is_a_seeded_permutation_per_epoch():
    order = GlobalOrder(10, seed=3)
    first = order.samples(range(10))
    assert sorted(first) == list(range(10))
    second = order.samples(range(10, 20))
    assert sorted(second) == list(range(10)) and second != first
    assert GlobalOrder(10, seed=3).samples(range(25)) == order.samples(range(25))


def test_parquet_tokens_load_and_bad_data_is_named(tmp_path):
    rows = [[i % 7, (i + 1) % 7, (i + 2) % 7] for i in range(9)]
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": rows}), path)
    src = open_source(str(path), "tokens", 4, vocab_size=8, seq_len=4, seed=0)
    x, y = src.batch(range(9))
    assert x.shape == (9, 2) and sorted(map(tuple, torch.cat([x, y[:, -1:]], 1).tolist())) == sorted(map(tuple, rows))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 5"):
        open_source(str(path), "tokens", 4, vocab_size=5, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="exceed the model's seq_len 1"):
        open_source(str(path), "tokens", 4, vocab_size=8, seq_len=1, seed=0)
    with pytest.raises(ValueError, match="no column 'ids'"):
        open_source(str(path), "ids", 4, vocab_size=8, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="no dataset at"):
        open_source(str(tmp_path / "none.parquet"), "tokens", 4, vocab_size=8, seq_len=4, seed=0)
