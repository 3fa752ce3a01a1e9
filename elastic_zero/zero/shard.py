"""A rank's ZeRO shard as plain data: what resharding, replication and checkpoints move."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import Partition, Range, partition_layout
from elastic_zero.plan.reshard import plan_reshard


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
        return self.partition.rank_numel(self.rank)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.vectors.values())

    def check(self) -> None:
        """Raise ValueError unless every vector holds exactly the elements of the ranges."""
        for name, vec in self.vectors.items():
            if vec.dim() != 1 or vec.numel() != self.numel:
                raise ValueError(
                    f"shard vector {name!r} has {vec.numel()} elements (dim {vec.dim()}); "
                    f"rank {self.rank}'s ranges hold {self.numel}"
                )

    def unpacked(self, flat: torch.Tensor, rank: int, scalars: dict) -> "ShardState":
        """A state shaped like rank `rank`'s shard of this partition whose vectors are consecutive
        slices of `flat`, in vector-name order (views, not copies)."""
        numel = self.partition.rank_numel(rank)
        names = sorted(self.vectors)
        if flat.numel() != numel * len(names):
            raise ValueError(f"packed shard of rank {rank} has {flat.numel()} elements, expected {numel * len(names)}")
        vectors = {name: flat[i * numel : (i + 1) * numel] for i, name in enumerate(names)}
        return ShardState(self.layout, self.partition, rank, vectors, dict(scalars))

    def to(self, device: torch.device | str) -> "ShardState":
        return ShardState(self.layout, self.partition, self.rank,
                          {k: v.to(device, copy=True) for k, v in self.vectors.items()}, dict(self.scalars))


def check_shard_fits(state: ShardState, layout: FlatLayout, partition: Partition, rank: int,
                     vector_names: Sequence[str]) -> None:
    """Raise ValueError, naming what differs, unless `state` is `rank`'s shard of `partition`."""
    if state.layout != layout:
        raise ValueError(f"shard layout does not match the model: {layout.describe_mismatch(state.layout)}")
    if state.partition.world_size != partition.world_size:
        raise ValueError(f"shard was cut for world size {state.partition.world_size}, "
                         f"but the process group has {partition.world_size} ranks")
    if state.partition != partition or state.rank != rank:
        raise ValueError(f"shard belongs to rank {state.rank} of another partition; this is rank {rank}")
    missing = [n for n in vector_names if n not in state.vectors]
    extra = [n for n in state.vectors if n not in vector_names]
    if missing or extra:
        raise ValueError(f"shard vectors differ from the optimizer's: missing {missing}, unexpected {extra}")
    if "step" not in state.scalars:
        raise ValueError("shard scalars lack 'step'")
    state.check()


def reshard(states: Sequence[ShardState], world_size: int) -> list[ShardState]:
    """All ranks' shards of one partition, repartitioned over `world_size` ranks (in memory)."""
    if not states:
        raise ValueError("reshard needs the shards of every rank, got none")
    first = states[0]
    old = first.partition
    if sorted(s.rank for s in states) != list(range(old.world_size)):
        raise ValueError(f"reshard needs one shard per rank 0..{old.world_size - 1}, "
                         f"got ranks {sorted(s.rank for s in states)}")
    by_rank = {s.rank: s for s in states}
    for s in states:
        if s.layout != first.layout or s.partition != old:
            raise ValueError(f"shard of rank {s.rank} belongs to another layout or partition")
        if s.scalars != first.scalars or s.vectors.keys() != first.vectors.keys():
            raise ValueError(f"shard of rank {s.rank} disagrees with rank {first.rank} on scalars or vectors")
        s.check()
    new = partition_layout(first.layout, world_size)
    out = []
    for rank in range(world_size):
        numel = new.rank_numel(rank)
        vectors = {name: torch.empty(numel, dtype=v.dtype, device=v.device) for name, v in first.vectors.items()}
        out.append(ShardState(first.layout, new, rank, vectors, dict(first.scalars)))
    for t in plan_reshard(old, new):
        src = by_rank[t.src].vectors
        for name, dest in out[t.dst].vectors.items():
            dest[t.dst_offset : t.dst_offset + t.numel].copy_(src[name][t.src_offset : t.src_offset + t.numel])
    return out
