"""The global sample order: position p of the run is sample order(epoch)[p mod n], epoch = p // n,
with one seeded permutation per epoch. Any rank computes any position's sample."""

from __future__ import annotations

from typing import Sequence

import torch


class GlobalOrder:
    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"the data source has no samples (num_samples={num_samples})")
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.num_samples, generator=g), epoch
        return self._perm

    def samples(self, positions: Sequence[int]) -> list[int]:
        out = []
        for p in positions:
            epoch, i = divmod(int(p), self.num_samples)
            out.append(int(self._permutation(epoch)[i]))
        return out
