"""The token dataset of `elastic-zero bench data`, generated once and reused: about size_gb GB of
int32 tokens in FILES Arrow IPC (or Parquet) files, rows of seq_len + 1 random token ids in record
batches (row groups) of batch_rows rows. The first token of each row is the row's index rather
than a token, so a reader proves from the tensors it made that it read every sample exactly once.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

COLUMN = "tokens"
VOCAB = 50257  # GPT-2's: the random tokens' range
FILES = 16  # several files, so the baseline's workers can split the scan by file
_MANIFEST = "_bench_data.json"  # "_" hides it from ArrowRows and pyarrow.dataset
_SUFFIX = {"ipc": "arrow", "parquet": "parquet"}


def token_dataset(directory: str, size_gb: float, fmt: str = "ipc", seq_len: int = 1024,
                  batch_rows: int = 2048, seed: int = 0) -> dict:
    """The token dataset of these parameters under `directory`, generated unless a complete one is
    there: its manifest (params, rows, disk_bytes) with "path", the dataset's directory."""
    if fmt not in _SUFFIX:
        raise ValueError(f"--format must be one of {', '.join(_SUFFIX)}, got {fmt!r}")
    if size_gb <= 0 or seq_len < 1 or batch_rows < 1:
        raise ValueError("--size-gb must be > 0, --seq-len and --batch-rows >= 1")
    params = {"size_gb": size_gb, "format": fmt, "seq_len": seq_len, "batch_rows": batch_rows, "seed": seed,
              "vocab": VOCAB, "files": FILES}
    path = os.path.join(directory, f"{fmt}-{size_gb:g}gb-seq{seq_len}")
    manifest_path = os.path.join(path, _MANIFEST)
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        if manifest["params"] == params:
            return {**manifest, "path": path}
    except (OSError, ValueError, KeyError):
        pass  # absent, or left incomplete by an interrupted run: generate it again
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name == _MANIFEST or name.startswith("part-"):
            os.remove(os.path.join(path, name))
    rows = max(FILES, int(size_gb * 1e9) // ((seq_len + 1) * 4))
    first = 0
    for f in range(FILES):
        n = rows // FILES + (1 if f < rows % FILES else 0)
        _write_file(os.path.join(path, f"part-{f:05d}.{_SUFFIX[fmt]}"), fmt, first, n, seq_len, batch_rows,
                    np.random.default_rng([seed, f]))
        first += n
    manifest = {"params": params, "rows": rows,
                "disk_bytes": sum(os.path.getsize(os.path.join(path, p)) for p in os.listdir(path))}
    with open(manifest_path + ".tmp", "w") as fh:
        json.dump(manifest, fh)
    os.replace(manifest_path + ".tmp", manifest_path)  # written last: its presence says the data is complete
    return {**manifest, "path": path}


def _write_file(path: str, fmt: str, first: int, rows: int, seq_len: int, batch_rows: int, rng) -> None:
    """Rows first..first+rows-1, one record batch (row group) of at most batch_rows rows at a time,
    so no more than one batch is ever in memory."""
    schema = pa.schema([(COLUMN, pa.list_(pa.int32()))])
    writer = ipc.new_file(path, schema) if fmt == "ipc" else pq.ParquetWriter(path, schema)
    with writer:
        for start in range(first, first + rows, batch_rows):
            n = min(batch_rows, first + rows - start)
            tokens = rng.integers(0, VOCAB, size=(n, seq_len + 1), dtype=np.int32)
            tokens[:, 0] = np.arange(start, start + n, dtype=np.int32)  # the row's index: the readers' check
            offsets = pa.array(np.arange(0, n * (seq_len + 1) + 1, seq_len + 1, dtype=np.int32))
            lists = pa.ListArray.from_arrays(offsets, pa.array(tokens.reshape(-1)))
            writer.write_batch(pa.record_batch([lists], schema=schema))
