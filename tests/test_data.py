import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert [len(rank_positions(step, batch, world, r)) for r in range(world)] == list(shares)
    with pytest.raises(ValueError, match=f"rank {world} is outside"):
        rank_positions(step, batch, world, world)
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




@settings(max_examples=25, deadline=None)
@given(st.integers(2, 50), st.integers(1, 40), st.integers(0, 3), st.integers(1, 4),
       st.lists(st.integers(0, 10**9), max_size=6))
def test_a_synthetic_sample_is_its_own_walk_on_the_chain_whatever_batch_it_is_read_in(vocab, seq_len, seed,
                                                                                    branching, indices):
    """Oracle: each sample walked alone, position by position, from its own seeded generator."""
    from elastic_zero.data.synthetic import MarkovTokens

    branching = min(branching, vocab)
    corpus = MarkovTokens(vocab, seq_len, seed, branching)
    walks = corpus.tokens(indices)
    assert walks.shape == (len(indices), seq_len + 1) and walks.dtype == torch.long
    for row, i in zip(walks, indices):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i + 1)
        token = int(torch.randint(0, vocab, (1,), generator=g))
        choices = torch.randint(0, branching, (seq_len,), generator=g).tolist()
        walk = [token]
        for c in choices:
            token = int(corpus.successors[token, c])
            walk.append(token)
        assert row.tolist() == walk
