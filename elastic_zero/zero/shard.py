"""A rank's ZeRO shard as plain data: what resharding, replication and checkpoints move."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import Partition, Range


@dataclass
class ShardState:
    """For each state vector, the rank's elements of every unit's range, concatenated in unit order.

    Vectors: "params" (fp32 master), then the optimizer's ("exp_avg", "exp_avg_sq" or "momentum").
    Scalars: "step" (completed optimizer steps) and whatever else the engine counts.
    """

    layout: FlatLayout
    partition: Partition
    rank: int
    vectors: dict[str, torch.Tensor]
    scalars: dict[str, float | int] = field(default_factory=dict)

    @property
    def ranges(self) -> tuple[Range, ...]:
        return self.partition.ranges(self.rank)

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.ranges)

    def check(self) -> None:
        """Raise ValueError unless every vector holds exactly the elements of the ranges."""
        for name, vec in self.vectors.items():
            if vec.dim() != 1 or vec.numel() != self.numel:
                raise ValueError(
                    f"shard vector {name!r} has {vec.numel()} elements (dim {vec.dim()}); "
                    f"rank {self.rank}'s ranges hold {self.numel}"
                )

    def to(self, device: torch.device | str) -> "ShardState":
        return ShardState(self.layout, self.partition, self.rank,
                          {k: v.to(device, copy=True) for k, v in self.vectors.items()}, dict(self.scalars))
