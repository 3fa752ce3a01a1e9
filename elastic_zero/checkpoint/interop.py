"""Plain PyTorch state dicts in and out of sharded checkpoints."""

from __future__ import annotations

from typing import Mapping, Sequence

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint.store import load_shard, read_manifest
from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero.shard import ShardState


def export_state_dict(fs: pafs.FileSystem, directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 parameters as {name: tensor}, loadable with torch.load(weights_only=True)."""
    manifest = read_manifest(fs, directory)
    layout = FlatLayout.from_dict(manifest.layout)
    flat = load_shard(fs, directory, layout, 1, 0, ["params"]).vectors["params"]
    return {s.name: flat[s.offset : s.end].view(s.shape).clone() for s in layout.slots}


def shards_from_state_dict(state_dict: Mapping[str, torch.Tensor], layout: FlatLayout, world_size: int,
                           vector_names: Sequence[str], step: int = 0) -> list[ShardState]:
    """Every rank's shard for `layout` from plain weights (optimizer state zero), e.g. pretrained ones."""
    missing = [s.name for s in layout.slots if s.name not in state_dict]
    wrong = [f"{s.name}: {tuple(state_dict[s.name].shape)} vs {s.shape}" for s in layout.slots
             if s.name in state_dict and tuple(state_dict[s.name].shape) != s.shape]
    if missing or wrong:
        raise ValueError(f"state dict does not fit the model: missing {missing[:3]}, shapes {wrong[:3]}")
    flat = torch.zeros(layout.total)
    for s in layout.slots:
        flat[s.offset : s.end] = state_dict[s.name].detach().float().reshape(-1)
    partition = partition_layout(layout, world_size)
    out = []
    for rank in range(world_size):
        params = torch.cat([flat[r.start : r.stop] for r in partition.ranges(rank)])
        vectors = {n: (params if n == "params" else torch.zeros_like(params)) for n in vector_names}
        out.append(ShardState(layout, partition, rank, vectors, {"step": step}))
    return out
