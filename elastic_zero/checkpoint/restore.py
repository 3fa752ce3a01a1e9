"""The one restore path from checkpoints, for a job that resumes and for a recovery that finds no
complete step in memory: every rank of the generation tries the same candidates in the same order
and all take the first one that every rank could read. A damaged candidate (a checksum, a missing
file, a bad manifest) is passed over by all ranks together, with a warning that names it."""

from __future__ import annotations

import warnings
from typing import Sequence

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint.store import load_shard
from elastic_zero.plan.layout import FlatLayout
from elastic_zero.zero.shard import ShardState


class RestoreError(ValueError):
    """No candidate checkpoint could be read by every rank."""


def restore_shard(fs: pafs.FileSystem, candidates: Sequence[str], layout: FlatLayout, world_size: int, rank: int,
                  vector_names: Sequence[str], comm, device: torch.device) -> tuple[ShardState, str]:
    """This rank's shard from the first of `candidates` that every rank of `comm` can read, and
    that checkpoint's directory. `comm` is the generation's Comm (one all-reduce per candidate)."""
    problems = []
    for directory in candidates:
        try:
            state, problem = load_shard(fs, directory, layout, world_size, rank, vector_names), ""
        except (ValueError, OSError) as exc:  # ChecksumError is a ValueError
            state, problem = None, f"{type(exc).__name__}: {exc}"
        loaded = torch.tensor([0.0 if state is None else 1.0], device=device)
        comm.all_reduce(loaded, op="min")
        if loaded.item() == 1.0:
            return state, directory
        problems.append(f"{directory}: {problem or 'damaged on another rank'}")
        if problem:  # said by the ranks that read the damage; the others only follow them
            warnings.warn(f"checkpoint {directory} is damaged ({problem}); trying the one committed before it",
                          stacklevel=2)
    raise RestoreError("no checkpoint could be restored: " + ("; ".join(problems) or "none was given"))
