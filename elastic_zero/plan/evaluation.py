"""When a job evaluates, and how an evaluation's samples are split over the ranks of the moment. Pure.

The eval set is positions [0, n) of the eval source. The job evaluates at step 0 (the weights it
starts from), every `every` steps, and after its last step. Rank r of N evaluates a contiguous share
of the set (the first n % N ranks one more), cut into as many micro batches as every other rank runs
(a stage-3 forward gathers parameters, a collective; a rank short of samples runs a stand-in of
weight 0). The ranks then sum (weight, weight * loss) over the set, so the result is the exact
weighted mean of the whole set, whatever N is.
"""

from __future__ import annotations

from elastic_zero.plan.batches import micro_batches


def eval_due(step: int, every: int, steps: int) -> bool:
    """Whether the weights after `step` optimizer steps are evaluated."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return step % every == 0 or step == steps


def eval_size(batches: int | None, global_batch: int, num_samples: int | None) -> int:
    """How many samples an evaluation covers: `batches` global batches, at most the whole set
    (`num_samples`; None: a source without end), or the whole set when `batches` is None."""
    if batches is None:
        if num_samples is None:
            raise ValueError("eval.batches: is required for a source without end (synthetic data)")
        return num_samples
    if batches < 1 or global_batch < 1:
        raise ValueError(f"eval.batches and train.global_batch must be >= 1, got {batches} and {global_batch}")
    return batches * global_batch if num_samples is None else min(batches * global_batch, num_samples)


def eval_shares(size: int, world_size: int) -> tuple[range, ...]:
    """Each rank's contiguous positions of an eval set of `size` samples."""
    if world_size < 1 or size < 0:
        raise ValueError(f"an eval set of {size} samples cannot be split over {world_size} ranks")
    base, extra = divmod(size, world_size)
    shares, start = [], 0
    for rank in range(world_size):
        count = base + (1 if rank < extra else 0)
        shares.append(range(start, start + count))
        start += count
    return tuple(shares)


def eval_micro_batches(size: int, world_size: int, rank: int, micro_batch: int) -> list[range]:
    """Rank `rank`'s share cut into the micro batches every rank runs (as many as the largest share
    needs; some may be empty)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    shares = eval_shares(size, world_size)
    count = max(1, -(-max(len(s) for s in shares) // micro_batch))
    return micro_batches(shares[rank], count)
