"""From Arrow rows to a batch: a dict of tensors. The default reads a column of token-id lists.

`token_collate` cuts every row to seq_len + 1 tokens and pads with `pad_id` (the targets with
IGNORE, so padding adds no loss term): to exactly seq_len when the data spec fixes it, else to the
longest row of the micro batch. It gives the next-token `targets` and each sample's number of real
targets as its `sample_weight`, so the default loss is a mean over tokens (see losses.py).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pyarrow as pa
import torch

from elastic_zero.losses import IGNORE, WEIGHT_KEY


class BadRow(ValueError):
    """A row the collate cannot use; `row` is its index in the batch, for the source to name."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(message)
        self.row = row


def token_collate(rows: pa.Table, column: str, seq_len: int | None, pad_id: int = 0,
                  fixed_length: bool = False) -> dict[str, torch.Tensor]:
    chunks = rows.column(column)
    array = chunks.chunk(0) if chunks.num_chunks == 1 else chunks.combine_chunks()
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) or \
            not pa.types.is_integer(array.type.value_type):
        raise ValueError(f"data.column: {column!r} must hold lists of integer token ids, not {array.type}")
    if array.null_count == 0:  # the buffers as they are: far cheaper than Arrow's kernels for a few rows
        offsets = array.offsets.to_numpy()
        lengths = np.diff(offsets).astype(np.int64)
        values = array.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    else:
        lengths = array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
        values = array.flatten().to_numpy(zero_copy_only=False)  # flatten() skips null rows' values
    if lengths.min() < 2:
        i = int(np.argmax(lengths < 2))
        raise BadRow(i, f"{column!r} holds {int(lengths[i])} token ids; a sample needs at least 2")
    keep = np.minimum(lengths, seq_len + 1) if seq_len is not None else lengths
    width = seq_len if fixed_length and seq_len is not None else int(keep.max()) - 1
    if values.dtype.kind in "iu" and (lengths == lengths[0]).all() and (keep == width + 1).all():
        # Rows of one length that fill the batch exactly (fixed-length samples, the usual case): views
        # of one reshape, instead of a loop over rows that made the collate most of a batch's time.
        rows_2d = values.reshape(len(lengths), -1)
        input_ids, targets = rows_2d[:, :width].astype(np.int64), rows_2d[:, 1 : width + 1].astype(np.int64)
    else:
        tokens = np.full((len(lengths), width + 1), pad_id, dtype=np.int64)
        targets = np.full((len(lengths), width), IGNORE, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for i, (start, n) in enumerate(zip(starts, keep)):
            row = values[start : start + n]
            tokens[i, :n] = row
            targets[i, : n - 1] = row[1:]
        input_ids = tokens[:, :-1].copy()
    return {"input_ids": torch.from_numpy(input_ids), "targets": torch.from_numpy(targets),
            WEIGHT_KEY: torch.from_numpy(keep - 1).to(torch.float32)}


def checked_batch(batch, where: str = "data.collate") -> dict[str, torch.Tensor]:
    """A user's collate must give a dict of tensors, all with the same number of samples."""
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"{where}: must return a non-empty dict of tensors, got {type(batch).__name__}")
    sizes = set()
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"{where}: batch[{key!r}] must be a tensor with a sample dimension, got "
                             f"{type(value).__name__ if not isinstance(value, torch.Tensor) else 'a scalar'}")
        sizes.add(value.shape[0])
    if len(sizes) != 1:
        raise ValueError(f"{where}: the batch's tensors disagree on the number of samples ({sorted(sizes)})")
    weights = batch.get(WEIGHT_KEY)
    if weights is not None and (weights.dim() != 1 or bool((weights < 0).any())):
        raise ValueError(f"{where}: batch[{WEIGHT_KEY!r}] must be a 1-D tensor of weights >= 0")
    return dict(batch)
