"""The runs of a rank's shard that share hyperparameters, as lists of views the optimizer updates.

Adjacent pieces of one unit with the same hyperparameters merge into one run; the alignment
padding between them is zero in every vector and stays zero under AdamW and SGD.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import Partition, shard_pieces


UPDATE_BATCH_NUMEL = 1 << 24  # elements updated by one call: bounds the optimizer's temporaries (64 MB in fp32)


def update_groups(
    layout: FlatLayout,
    partition: Partition,
    rank: int,
    optimizer,
    units: Sequence,
    unit_views: Mapping[str, Callable[[object], torch.Tensor]],
    batch_numel: int | None = None,
) -> list[tuple[object, dict[str, list[torch.Tensor]]]]:
    """[(hyper, {vector name: [views]})]; `unit_views[name](unit)` is the unit's chunk of a vector.

    Each entry holds at most `batch_numel` elements: AdamW's foreach ops allocate temporaries as
    large as their input (sqrt of exp_avg_sq), and one call over a whole shard would double its
    size for the moment. The update is elementwise, so batching changes no result."""
    batch_numel = batch_numel or UPDATE_BATCH_NUMEL
    runs: list[tuple] = []  # (hyper, unit, start, stop) in shard coordinates
    for piece in shard_pieces(layout, partition, rank):
        slot = layout.slots[piece.slot]
        hyper = optimizer.hyper_for(slot.name, slot.shape)
        stop = piece.shard_offset + piece.numel
        if runs and runs[-1][0] == hyper and runs[-1][1] == slot.unit:
            runs[-1] = (hyper, slot.unit, runs[-1][2], stop)
        else:
            runs.append((hyper, slot.unit, piece.shard_offset, stop))
    batches: dict = {}  # hyper -> [(numel, {name: [views]})], the last one filling
    for hyper, ui, run_start, run_stop in runs:
        base = partition.shard_unit_offset(ui)
        for start in range(run_start, run_stop, batch_numel):
            stop = min(start + batch_numel, run_stop)
            of_hyper = batches.setdefault(hyper, [])
            if not of_hyper or of_hyper[-1][0] + (stop - start) > batch_numel:
                of_hyper.append((0, {name: [] for name in unit_views}))
            numel, views = of_hyper[-1]
            for name, view_of in unit_views.items():
                views[name].append(view_of(units[ui])[start - base : stop - base])
            of_hyper[-1] = (numel + stop - start, views)
    return [(hyper, views) for hyper, of_hyper in batches.items() for _, views in of_hyper]
