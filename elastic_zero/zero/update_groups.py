"""The runs of a rank's shard that share hyperparameters, as lists of views the optimizer updates.

Adjacent pieces of one unit with the same hyperparameters merge into one run; the alignment
padding between them is zero in every vector and stays zero under AdamW and SGD.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import Partition, shard_pieces


def update_groups(
    layout: FlatLayout,
    partition: Partition,
    rank: int,
    optimizer,
    units: Sequence,
    unit_views: Mapping[str, Callable[[object], torch.Tensor]],
) -> list[tuple[object, dict[str, list[torch.Tensor]]]]:
    """[(hyper, {vector name: [views]})]; `unit_views[name](unit)` is the unit's chunk of a vector."""
    runs: list[tuple] = []  # (hyper, unit, start, stop) in shard coordinates
    for piece in shard_pieces(layout, partition, rank):
        slot = layout.slots[piece.slot]
        hyper = optimizer.hyper_for(slot.name, slot.shape)
        stop = piece.shard_offset + piece.numel
        if runs and runs[-1][0] == hyper and runs[-1][1] == slot.unit:
            runs[-1] = (hyper, slot.unit, runs[-1][2], stop)
        else:
            runs.append((hyper, slot.unit, piece.shard_offset, stop))
    groups: dict = {}
    for hyper, ui, start, stop in runs:
        base = partition.shard_unit_offset(ui)
        views = groups.setdefault(hyper, {name: [] for name in unit_views})
        for name, view_of in unit_views.items():
            views[name].append(view_of(units[ui])[start - base : stop - base])
    return list(groups.items())
