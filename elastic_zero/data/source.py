"""Open the training data of a job: samples addressed by global position (see plan/batches.py)."""

from __future__ import annotations

from typing import Sequence

import torch

from elastic_zero.data.order import GlobalOrder
from elastic_zero.data.synthetic import MarkovTokens


class PositionedSource:
    """Maps global sample positions to samples: a shuffled order per epoch for finite datasets;
    the synthetic walks are independent draws already, so their position is their index."""

    def __init__(self, source, order: GlobalOrder | None) -> None:
        self.source, self.order = source, order

    def batch(self, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.order.samples(positions) if self.order is not None else list(positions)
        return self.source.batch(ids)


def open_source(source: str, column: str, branching: int, vocab_size: int, seq_len: int, seed: int) -> PositionedSource:
    if source == "synthetic":
        return PositionedSource(MarkovTokens(vocab_size, seq_len, seed=seed, branching=branching), None)
    from elastic_zero.data.parquet import ParquetTokens

    data = ParquetTokens(source, column)
    if data.seq_len > seq_len:
        raise ValueError(f"data.source: sequences of {data.seq_len} tokens exceed the model's seq_len {seq_len}")
    top = int(data.tokens_table.max())
    if top >= vocab_size:
        raise ValueError(f"data.source: token id {top} is outside the model's vocabulary of {vocab_size}")
    return PositionedSource(data, GlobalOrder(data.num_samples, seed))
