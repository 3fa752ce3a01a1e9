"""A step's micro batches, made one step ahead: the trainer asks for the next step's while the device
still runs this one's backward (queued, before the host waits to read the step's closing
all-reduce), so that building them (a collate, a read, the synthetic corpus's walk) and pinning them
for the copy to a GPU are off the step's critical path. Measured on an H200 (GPT-2 124M's shape,
micro batch 8 x 1,024 tokens): the synthetic batch alone took 7% of the job's step on the host.

A batch depends only on its sample positions, so one made ahead is the one the step would make:
it is kept under the step, world size and rank it was made for, and made again for anything else
(a new generation's layout). An error while making it ahead is raised when its step asks for it,
as it would have been without the read-ahead.
"""

from __future__ import annotations

from typing import Callable

import torch

from elastic_zero.data.source import read_ahead_for_step
from elastic_zero.plan.batches import micro_batch_count, micro_batches, rank_positions


class StepBatches:
    def __init__(self, source, global_batch: int, micro_batch: int, steps: int, device: torch.device) -> None:
        self.source = source
        self.global_batch, self.micro_batch, self.steps = global_batch, micro_batch, steps
        self._pin = device.type == "cuda"  # a pinned batch's copy to the device does not block the host
        self._ahead: tuple | None = None  # (key, made) or (key, the error making it raised)

    def of_step(self, step: int, world: int, rank: int) -> tuple[range, list[range], list[dict]]:
        """(this rank's positions, its micro batches' positions, the micro batches) of `step`."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (step, world, rank):
            if isinstance(ahead[1], BaseException):
                raise ahead[1]
            return ahead[1]
        return self._make(step, world, rank)

    def prepare(self, step: int, world: int, rank: int) -> None:
        """Make `step`'s batches now, for of_step() to hand over (nothing past the last step)."""
        if step >= self.steps:
            return
        try:
            made = self._make(step, world, rank)
        except Exception as exc:  # its step raises it
            made = exc
        self._ahead = ((step, world, rank), made)

    def forget(self) -> None:
        self._ahead = None

    def _make(self, step: int, world: int, rank: int) -> tuple[range, list[range], list[dict]]:
        share_of: Callable[[int], range] = lambda s: rank_positions(s, self.global_batch, world, rank)  # noqa: E731
        positions = share_of(step)
        micro = micro_batches(positions, micro_batch_count(self.global_batch, world, self.micro_batch))
        read_ahead_for_step(self.source, step, self.steps, share_of)
        # every rank runs as many micro batches (and so collectives) as the others: an empty piece
        # runs a stand-in sample with weight 0
        batches = [self.source.batch(m or positions[:1]) for m in micro]
        if self._pin:
            batches = [{k: _pinned(v) for k, v in b.items()} for b in batches]
        return positions, micro, batches


def _pinned(value):
    """A host tensor's contiguous copy in pinned memory (one that keeps a view's strides, as
    pin_memory() does, would still be copied through pageable memory on its way to the device);
    anything else, or a tensor whose memory could not be pinned, as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    try:
        pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    except RuntimeError:  # pinned memory refused: the copy goes from pageable memory, as without this
        return value
    return pinned.copy_(value)
