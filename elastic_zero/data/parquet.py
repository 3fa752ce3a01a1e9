"""Token sequences from an Arrow/Parquet dataset (a local path or a URI pyarrow.fs understands).

One row per sample; `column` holds a list of seq_len + 1 token ids.
"""

from __future__ import annotations

from typing import Sequence

import pyarrow.dataset as ds
import torch


class ParquetTokens:
    def __init__(self, source: str, column: str = "tokens", fmt: str | None = None) -> None:
        fmt = fmt or ("arrow" if source.endswith((".arrow", ".feather", ".ipc")) else "parquet")
        try:
            dataset = ds.dataset(source, format=fmt)
        except FileNotFoundError:
            raise ValueError(f"data.source: no dataset at {source!r}") from None
        if column not in dataset.schema.names:
            raise ValueError(f"data.column: {source!r} has no column {column!r} "
                             f"(it has {', '.join(dataset.schema.names)})")
        table = dataset.to_table(columns=[column])
        rows = table.column(column).to_pylist()
        if not rows:
            raise ValueError(f"data.source: {source!r} has no rows")
        lengths = {len(r) for r in rows}
        if len(lengths) != 1 or min(lengths) < 2:
            raise ValueError(f"data.column: rows of {column!r} must all hold the same number (>= 2) of token ids")
        self.tokens_table = torch.tensor(rows, dtype=torch.long)
        self.num_samples = len(rows)
        self.seq_len = self.tokens_table.shape[1] - 1

    def tokens(self, indices: Sequence[int]) -> torch.Tensor:
        return self.tokens_table[list(indices)]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokens(indices)
        return t[:, :-1], t[:, 1:]
