"""The next step's micro batches made ahead (worker/step_batches.py) are the ones the step would make,
handed over once, for the step, world size and rank they were made for only; an error made ahead is
the step's. Oracle: the synthetic source's own batches of the same positions."""

import pytest
import torch

from elastic_zero.data.source import SyntheticSource
from elastic_zero.data.synthetic import MarkovTokens
from elastic_zero.plan.batches import rank_positions
from elastic_zero.worker.step_batches import StepBatches


class _CountingSource(SyntheticSource):
    """The real synthetic source, counting the batches it makes, failing on the positions it is told."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(MarkovTokens(vocab_size=64, seq_len=8, seed=3))
        self.made, self.fail_at = 0, fail_at

    def batch(self, positions):
        self.made += 1
        if self.fail_at is not None and self.fail_at in positions:
            raise ValueError(f"data.source: row {self.fail_at} is bad")
        return super().batch(positions)


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_a_step_made_ahead_is_the_step_made_on_demand_and_is_handed_over_once():
    source = _CountingSource()
    ahead = StepBatches(source, global_batch=6, micro_batch=2, steps=10, device=torch.device("cpu"))
    ahead.prepare(4, world=2, rank=1)
    made = source.made
    positions, micro, batches = ahead.of_step(4, world=2, rank=1)
    assert source.made == made  # nothing made again
    assert positions == rank_positions(4, 6, 2, 1) == range(27, 30)
    assert [len(m) for m in micro] == [2, 1]
    assert _same(batches, [source.batch(m) for m in micro])
    again = source.made
    ahead.of_step(4, world=2, rank=1)  # asked twice: made anew, the same
    assert source.made == again + 2


@pytest.mark.parametrize("asked", [(5, 2, 1), (4, 3, 1), (4, 2, 0)])
def test_a_step_made_for_another_step_world_or_rank_is_made_anew(asked):
    source = _CountingSource()
    ahead = StepBatches(source, global_batch=6, micro_batch=2, steps=10, device=torch.device("cpu"))
    ahead.prepare(4, world=2, rank=1)
    step, world, rank = asked
    positions, micro, batches = ahead.of_step(step, world, rank)
    assert positions == rank_positions(step, 6, world, rank)
    assert _same(batches, [source.batch(m or positions[:1]) for m in micro])


def test_an_error_made_ahead_is_raised_by_its_step_and_nothing_is_made_past_the_last():
    source = _CountingSource(fail_at=28)
    ahead = StepBatches(source, global_batch=6, micro_batch=2, steps=10, device=torch.device("cpu"))
    ahead.prepare(4, world=2, rank=1)  # no raise here: the step before is still running
    with pytest.raises(ValueError, match="row 28 is bad"):
        ahead.of_step(4, world=2, rank=1)
    made = source.made
    ahead.prepare(10, world=2, rank=1)
    assert source.made == made


def test_a_batch_is_pinned_contiguous_where_memory_can_be_pinned_and_goes_as_it_is_where_not():
    from elastic_zero.worker.step_batches import _pinned

    view = torch.arange(20).reshape(4, 5)[:, 1:]  # the synthetic source's inputs: a view with strides
    pinned = _pinned(view)
    assert torch.equal(pinned, view)
    if torch.cuda.is_available():
        assert pinned.is_pinned() and pinned.is_contiguous()
    else:  # no pinned memory on this host: the batch goes from pageable memory, as without the read-ahead
        assert pinned is view
    assert _pinned("text") == "text"
