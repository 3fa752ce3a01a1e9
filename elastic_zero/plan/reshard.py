"""The reshard plan: which elements move from which rank to which when the partition changes.

Found by interval intersection of the old and new partitions of the same layout, unit by unit.
Offsets are in the coordinates of a ShardState vector: a rank's real elements of every unit,
concatenated in unit order. The same plan reads a checkpoint written at another world size
(the sources are then the saved files instead of live ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_zero.plan.partition import Partition


@dataclass(frozen=True)
class Transfer:
    src: int  # rank in the old partition
    dst: int  # rank in the new partition
    flat_offset: int  # first element in the flat layout
    numel: int
    src_offset: int  # where the elements sit in the source's shard vector
    dst_offset: int  # where they go in the destination's shard vector


def vector_offsets(partition: Partition, rank: int) -> tuple[int, ...]:
    """Where each unit's range starts in `rank`'s shard vector."""
    offsets, cursor = [], 0
    for r in partition.ranges(rank):
        offsets.append(cursor)
        cursor += r.numel
    return tuple(offsets)


def plan_reshard(old: Partition, new: Partition) -> tuple[Transfer, ...]:
    """Every element of the new partition, once, from the old rank that holds it."""
    if old.unit_offsets != new.unit_offsets or old.unit_numels != new.unit_numels:
        raise ValueError("cannot reshard between partitions of different layouts (their units differ)")
    old_vec = [vector_offsets(old, r) for r in range(old.world_size)]
    new_vec = [vector_offsets(new, r) for r in range(new.world_size)]
    transfers = []
    for unit in range(len(old.unit_offsets)):
        src_ranges = [old.unit_range(unit, r) for r in range(old.world_size)]
        for dst in range(new.world_size):
            want = new.unit_range(unit, dst)
            if not want.numel:
                continue
            first = old.owner(want.start)
            for src in range(first, old.world_size):
                have = src_ranges[src]
                lo, hi = max(have.start, want.start), min(have.stop, want.stop)
                if have.start >= want.stop:
                    break
                if lo >= hi:
                    continue
                transfers.append(Transfer(
                    src=src,
                    dst=dst,
                    flat_offset=lo,
                    numel=hi - lo,
                    src_offset=old_vec[src][unit] + lo - have.start,
                    dst_offset=new_vec[dst][unit] + lo - want.start,
                ))
    return tuple(transfers)


def received_from_others(plan: tuple[Transfer, ...], holder_of_old, member_of_new, me: int) -> int:
    """The elements process `me` receives from other processes when `plan` runs between processes
    (holder_of_old[r]: the process holding old rank r; member_of_new[r]: the process becoming new rank r)."""
    return sum(t.numel for t in plan if member_of_new[t.dst] == me and holder_of_old[t.src] != me)


def sends_and_receives(plan: tuple[Transfer, ...], rank_old: int | None, rank_new: int | None):
    """The transfers this process sends (as an old rank) and receives (as a new rank)."""
    sends = tuple(t for t in plan if t.src == rank_old) if rank_old is not None else ()
    receives = tuple(t for t in plan if t.dst == rank_new) if rank_new is not None else ()
    return sends, receives
