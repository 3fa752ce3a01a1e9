"""A real offline corpus: the Python standard library's own .py files, byte-tokenised (token id =
byte value, vocabulary 256) into a Parquet dataset of samples of up to seq_len + 1 bytes. The last
piece of each file is shorter: the samples are ragged, and the default collate pads them. Used by
`elastic-zero demo` and by examples/byte_gpt/make_dataset.py; examples/finetune_hf writes other
documents (English prose) the same way."""

from __future__ import annotations

import os
import sysconfig
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq


def stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
    return found


def file_bytes(paths: Iterable[str]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as fh:
            yield fh.read()


def samples(documents: Iterable[bytes], seq_len: int, max_bytes: int):
    """Pieces of seq_len + 1 bytes (the last piece of a document shorter), until max_bytes are taken."""
    taken = 0
    for data in documents:
        for start in range(0, len(data), seq_len + 1):
            piece = data[start : start + seq_len + 1]
            if len(piece) < 2:
                continue
            yield list(piece)
            taken += len(piece)
            if taken >= max_bytes:
                return


def write(out: str, seq_len: int, max_mb: float, rows_per_file: int = 8192, row_group: int = 512,
          documents: Iterable[bytes] | None = None) -> int:
    """Samples of `documents` (default: the standard library's .py files) into Parquet files under
    `out`; the number of samples."""
    os.makedirs(out, exist_ok=True)
    schema = pa.schema([("tokens", pa.list_(pa.uint8()))])
    rows, part, count = [], 0, 0

    def flush() -> None:
        nonlocal rows, part
        if rows:
            pq.write_table(pa.table({"tokens": rows}, schema=schema), os.path.join(out, f"part-{part:04d}.parquet"),
                           row_group_size=row_group)
            rows, part = [], part + 1

    documents = file_bytes(stdlib_sources()) if documents is None else documents
    for sample in samples(documents, seq_len, int(max_mb * 2**20)):
        rows.append(sample)
        count += 1
        if len(rows) == rows_per_file:
            flush()
    flush()
    return count
