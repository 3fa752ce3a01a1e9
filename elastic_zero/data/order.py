"""The global sample order: position p of the run is sample order(epoch)[p mod n], epoch = p // n,
with one seeded order per epoch. Any rank computes any position's sample.

The order permutes the blocks and the rows within each block, so that a streamed dataset
(ArrowRows) reads one or two blocks per rank and step."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch


def _generator(*key: int) -> torch.Generator:
    # One well-mixed 63-bit seed per key, the same in every process (no Python hash randomization).
    digest = hashlib.blake2b(repr(tuple(int(k) for k in key)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class BlockShuffledOrder:
    """Global position p -> sample index: epoch = p // num_samples; within an epoch the blocks are
    visited in a seeded random order and the rows of each block in a seeded random order, so a
    contiguous range of positions (one rank's share of a step) touches one or two blocks.

    Block sizes come from ArrowRows.block_sizes: the samples of block b are the next block_sizes[b]
    indices after those of blocks 0..b-1. Orders are built lazily and only a few are kept, so a
    huge dataset never needs a full permutation in memory."""

    _KEEP_EPOCHS, _KEEP_BLOCKS = 2, 8  # a step's positions span at most two epochs, a rank's share few blocks

    def __init__(self, block_sizes: Sequence[int], seed: int) -> None:
        sizes = [int(n) for n in block_sizes]
        if any(n < 0 for n in sizes):
            raise ValueError(f"block sizes must not be negative (got {min(sizes)})")
        self.num_samples, self.seed = sum(sizes), seed
        if self.num_samples < 1:
            raise ValueError(f"the data source has no samples (num_samples={self.num_samples})")
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(self._sizes)])  # first sample index of each block
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._rows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @staticmethod
    def _remember(cache: OrderedDict, key, make, keep: int):
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = make()
            if len(cache) > keep:
                cache.popitem(last=False)
        return cache[key]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The blocks in the order this epoch visits them, and the epoch offset where each visit starts."""
        def make():
            visit = torch.randperm(len(self._sizes), generator=_generator(self.seed, epoch)).numpy()
            return visit, np.concatenate([[0], np.cumsum(self._sizes[visit])])
        return self._remember(self._epochs, epoch, make, self._KEEP_EPOCHS)

    def _block_rows(self, epoch: int, block: int) -> np.ndarray:
        def make():
            return torch.randperm(int(self._sizes[block]), generator=_generator(self.seed, epoch, block)).numpy()
        return self._remember(self._rows, (epoch, block), make, self._KEEP_BLOCKS)

    def samples(self, positions: Sequence[int]) -> list[int]:
        p = np.asarray(positions, dtype=np.int64) if isinstance(positions, (list, tuple, range, np.ndarray)) \
            else np.fromiter(positions, dtype=np.int64)
        epochs, within = np.divmod(p, self.num_samples)
        out = np.empty_like(p)
        for epoch in np.unique(epochs).tolist():
            here = np.flatnonzero(epochs == epoch)
            visit, starts = self._epoch(epoch)
            # empty blocks share a start: side="right" passes them
            k = np.searchsorted(starts, within[here], side="right") - 1
            blocks, offsets = visit[k], within[here] - starts[k]
            for block in np.unique(blocks).tolist():
                mine = blocks == block
                out[here[mine]] = self._first[block] + self._block_rows(epoch, block)[offsets[mine]]
        return out.tolist()
