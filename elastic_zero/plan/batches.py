"""How a global batch is split over the ranks of the moment. Pure.

Step s consumes global sample positions [s*B, (s+1)*B). Rank r of N takes a contiguous share
(the first B % N ranks take one more) and cuts it into the same number of micro batches as every
other rank (each micro batch runs the engine's collectives, so the counts must match), each of at
most `micro_batch` samples. A rank with fewer samples than micro batches gets empty ones: it runs
a stand-in sample with weight 0. Each micro batch's mean loss is weighted by (its size * N / B),
so that the engine's average over ranks is exactly the mean over the global batch, whatever N is.
"""

from __future__ import annotations


def rank_shares(global_batch: int, world_size: int) -> tuple[int, ...]:
    if world_size < 1 or global_batch < world_size:
        raise ValueError(f"a global batch of {global_batch} cannot be split over {world_size} ranks")
    base, extra = divmod(global_batch, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def rank_positions(step: int, global_batch: int, world_size: int, rank: int) -> range:
    """The global sample positions rank `rank` trains on at step `step`. In constant time: every
    rank of every step calls it (1,024 simulated ranks at 4 steps a second made the O(N) sum of
    the shares before it the harness's largest cost)."""
    if world_size < 1 or global_batch < world_size:
        raise ValueError(f"a global batch of {global_batch} cannot be split over {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    base, extra = divmod(global_batch, world_size)
    start = step * global_batch + rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def micro_batch_count(global_batch: int, world_size: int, micro_batch: int) -> int:
    """How many micro batches every rank runs per step: enough for the largest share."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    return -(-max(rank_shares(global_batch, world_size)) // micro_batch)


def micro_batches(positions: range, count: int) -> list[range]:
    """`positions` cut into `count` contiguous pieces whose sizes differ by at most one (empty
    pieces when there are fewer positions than `count`)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    base, extra = divmod(len(positions), count)
    cuts = [0]
    for i in range(count):
        cuts.append(cuts[-1] + base + (1 if i < extra else 0))
    return [positions[cuts[i] : cuts[i + 1]] for i in range(count)]


def loss_weight(micro_size: int, global_batch: int, world_size: int) -> float:
    """The factor for a micro batch's mean loss so that rank-averaged gradients are the global mean."""
    return micro_size * world_size / global_batch
