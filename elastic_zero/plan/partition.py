"""The partition of a flat layout over N ranks.

Each unit is cut into N equal chunks of `chunk` elements (the last ones may hold fewer real
elements, or none). Equal chunks let a unit's buffer, padded to N * chunk, be reduce-scattered
and all-gathered in place. A rank's shard is the concatenation of its chunk of every unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_zero.plan.layout import FlatLayout


@dataclass(frozen=True)
class Range:
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in a rank's shard."""

    slot: int  # index into layout.slots
    param_offset: int  # first element of the piece inside the parameter
    shard_offset: int  # where the piece sits in the rank's padded shard buffer
    numel: int


@dataclass(frozen=True)
class Partition:
    world_size: int
    unit_offsets: tuple[int, ...]
    unit_numels: tuple[int, ...]
    chunks: tuple[int, ...]  # elements per rank, per unit

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's padded shard buffer (the same on every rank)."""
        return sum(self.chunks)

    def shard_unit_offset(self, unit: int) -> int:
        return sum(self.chunks[:unit])

    def unit_range(self, unit: int, rank: int) -> Range:
        """The rank's real elements of `unit`, in flat-layout coordinates (may be empty)."""
        self._check_rank(rank)
        c, n, off = self.chunks[unit], self.unit_numels[unit], self.unit_offsets[unit]
        return Range(off + min(rank * c, n), off + min((rank + 1) * c, n))

    def ranges(self, rank: int) -> tuple[Range, ...]:
        """The rank's real elements of every unit, in flat-layout coordinates."""
        return tuple(self.unit_range(u, rank) for u in range(len(self.chunks)))

    def rank_numel(self, rank: int) -> int:
        """The rank's real elements in all (its shard buffer's `shard_numel` less the padding)."""
        return sum(r.numel for r in self.ranges(rank))

    def owner(self, index: int) -> int:
        """The rank that owns flat element `index`."""
        for off, n, c in zip(self.unit_offsets, self.unit_numels, self.chunks):
            if off <= index < off + n:
                return (index - off) // c
        raise IndexError(f"flat index {index} is outside the layout")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "unit_offsets": list(self.unit_offsets),
            "unit_numels": list(self.unit_numels),
            "chunks": list(self.chunks),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Partition":
        try:
            return cls(
                world_size=int(data["world_size"]),
                unit_offsets=tuple(int(x) for x in data["unit_offsets"]),
                unit_numels=tuple(int(x) for x in data["unit_numels"]),
                chunks=tuple(int(x) for x in data["chunks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"partition dict is malformed: {exc!r}") from None


def partition_layout(layout: FlatLayout, world_size: int) -> Partition:
    """Cut every unit of `layout` into `world_size` equal, `layout.align`-aligned chunks."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    chunks = []
    for u in layout.units:
        per_rank = -(-u.numel // world_size)
        chunks.append(-(-per_rank // layout.align) * layout.align)
    return Partition(
        world_size=world_size,
        unit_offsets=tuple(u.offset for u in layout.units),
        unit_numels=tuple(u.numel for u in layout.units),
        chunks=tuple(chunks),
    )


def shard_pieces(layout: FlatLayout, partition: Partition, rank: int) -> tuple[Piece, ...]:
    """The pieces of parameters held in `rank`'s shard, in shard order."""
    pieces = []
    for si, slot in enumerate(layout.slots):
        r = partition.unit_range(slot.unit, rank)
        lo, hi = max(slot.offset, r.start), min(slot.end, r.stop)
        if lo >= hi:
            continue
        unit_start = partition.unit_offsets[slot.unit] + rank * partition.chunks[slot.unit]
        shard_offset = partition.shard_unit_offset(slot.unit) + (lo - unit_start)
        pieces.append(Piece(si, lo - slot.offset, shard_offset, hi - lo))
    return tuple(pieces)
