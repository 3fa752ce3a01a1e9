"""The global sample order: position p of the run is sample order(epoch)[p mod n], epoch = p // n,
with one seeded order per epoch. Any rank computes any position's sample.

The order permutes the blocks and the rows within each block, so that a streamed dataset
(ArrowRows) reads one or two blocks per rank and step."""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import OrderedDict
from typing import Sequence

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
        self._sizes = sizes
        self._first = list(itertools.accumulate(sizes, initial=0))  # first sample index of each block
        self._epochs: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()
        self._rows: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    @staticmethod
    def _remember(cache: OrderedDict, key, make, keep: int):
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = make()
            if len(cache) > keep:
                cache.popitem(last=False)
        return cache[key]

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """The blocks in the order this epoch visits them, and the epoch offset where each visit starts."""
        def make():
            visit = torch.randperm(len(self._sizes), generator=_generator(self.seed, epoch)).tolist()
            return visit, list(itertools.accumulate((self._sizes[b] for b in visit), initial=0))
        return self._remember(self._epochs, epoch, make, self._KEEP_EPOCHS)

    def _block_rows(self, epoch: int, block: int) -> list[int]:
        def make():
            return torch.randperm(self._sizes[block], generator=_generator(self.seed, epoch, block)).tolist()
        return self._remember(self._rows, (epoch, block), make, self._KEEP_BLOCKS)

    def samples(self, positions: Sequence[int]) -> list[int]:
        out = []
        for p in positions:
            epoch, i = divmod(int(p), self.num_samples)
            visit, starts = self._epoch(epoch)
            k = bisect.bisect_right(starts, i) - 1  # empty blocks share a start; bisect_right passes them
            block = visit[k]
            out.append(self._first[block] + self._block_rows(epoch, block)[i - starts[k]])
        return out
