"""Rows of an Arrow IPC or Parquet dataset, read by global sample index without loading the dataset.

The dataset is a sequence of blocks (Parquet row groups, Arrow IPC record batches) taken file by
file in path order. Opening it reads only metadata (footers); `rows()` reads just the blocks that
hold the asked samples and keeps the few most recently read ones, so a worker that reads its
share of a step in block-shuffled order (see order.BlockShuffledOrder) touches one or two blocks.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

_IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
_OPEN_FILES = 16  # readers kept open at once; more files than this are reopened on demand


class DataError(ValueError):
    """A problem with the data, in one line naming the spec field (data.source or data.column) and the file."""


def _reason(error: BaseException) -> str:
    # Arrow's messages span lines; the error must stay on one.
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _hidden(relative: str) -> bool:
    # The same files pyarrow.dataset skips by default (_SUCCESS, .crc, _metadata ...).
    return any(part.startswith((".", "_")) for part in relative.split("/") if part)


class _File:
    """One data file: its blocks' row counts from metadata, and a reader opened on demand."""

    def __init__(self, fs: pafs.FileSystem, path: str, ipc_format: bool, local: bool) -> None:
        self.fs, self.path, self.ipc_format, self.local = fs, path, ipc_format, local
        self.handle = self.reader = None

    def _source(self) -> pa.NativeFile:
        # A local IPC file is memory-mapped: its record batches are then views of the page cache.
        return pa.memory_map(self.path) if self.ipc_format and self.local else self.fs.open_input_file(self.path)

    def schema(self) -> pa.Schema:
        self.handle = self._source()
        if self.ipc_format:
            return ipc.open_file(self.handle).schema
        self.reader = pq.ParquetFile(self.handle)
        return self.reader.schema_arrow

    def open(self, fields: list[int]) -> None:
        """`fields`: the schema indices of the columns read; an IPC reader of a remote file then fetches
        only their buffers."""
        if self.handle is None:
            self.handle = self._source()
        if self.ipc_format:
            # A memory-mapped file is read zero-copy only without included_fields: with them pyarrow
            # copies every batch it reads (block_rows too: the whole file at open); read() selects.
            options = None if self.local else ipc.IpcReadOptions(included_fields=fields)
            self.reader = ipc.open_file(self.handle, options=options)
        elif self.reader is None:
            self.reader = pq.ParquetFile(self.handle)

    def close(self) -> None:
        # Safe with cached blocks: a memory map stays alive while any buffer of it does.
        if self.handle is not None:
            self.handle.close()
        self.handle = self.reader = None

    def block_rows(self) -> list[int]:
        if self.ipc_format:  # IPC keeps row counts in each batch's header, which get_batch reads
            return [self.reader.get_batch(i).num_rows for i in range(self.reader.num_record_batches)]
        meta = self.reader.metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    def read(self, block: int, columns: list[str]) -> pa.Table:
        if self.ipc_format:
            return pa.Table.from_batches([self.reader.get_batch(block)]).select(columns)
        return self.reader.read_row_group(block, columns=columns).select(columns)


def _schema_difference(a: pa.Schema, b: pa.Schema) -> str:
    if a.names != b.names:
        return f"columns {', '.join(a.names)} vs {', '.join(b.names)}"
    for fa, fb in zip(a, b):
        if not fa.equals(fb):
            return f"column {fa.name!r}: {fa.type}{'' if fa.nullable else ' not null'} vs " \
                   f"{fb.type}{'' if fb.nullable else ' not null'}"
    return "schema metadata"


class ArrowRows:
    """An Arrow IPC (.arrow/.feather/.ipc) or Parquet dataset - a file, a directory of them, or a
    pyarrow.fs URI (file://, s3:// ...) - read by sample index without loading it: only the
    blocks (Parquet row groups, Arrow IPC record batches) that hold the asked samples are read,
    and the few most recently read blocks are cached.

    block_sizes lists the rows of each non-empty block, in dataset order (files sorted by path,
    then block order); blocks_read counts the blocks decoded so far (cache misses)."""

    def __init__(self, source: str, columns: Sequence[str] | None = None, cache_blocks: int = 4) -> None:
        self.source, self.cache_blocks, self.blocks_read = source, max(0, cache_blocks), 0
        fs, base = self._filesystem(source)
        try:
            info = fs.get_file_info(base)
            if info.type == pafs.FileType.NotFound:
                raise DataError(f"data.source: no dataset at {source!r}")
            ipc_format = self._is_ipc(fs, base, info)
            paths = sorted(ds.dataset(base, filesystem=fs, format="ipc" if ipc_format else "parquet").files)
        except DataError:
            raise
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.source: cannot read {source!r} ({_reason(e)})") from None
        if not paths:
            raise DataError(f"data.source: no data files in {source!r}")
        self._base, self._is_dir = base, info.type == pafs.FileType.Directory
        local = isinstance(fs, pafs.LocalFileSystem)
        self._files = [_File(fs, p, ipc_format, local) for p in paths]
        self._open: OrderedDict[int, _File] = OrderedDict()
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()

        schema = self._schemas()
        self.columns = self._chosen_columns(schema, columns)
        self._schema = pa.schema([schema.field(c) for c in self.columns])
        self._fields = [schema.get_field_index(c) for c in self.columns]

        sizes, where_block = [], []  # where_block[b]: (file, block in file, first row of block in file)
        for f, file in enumerate(self._files):
            self._use(f)
            row = 0
            for i, n in enumerate(self._guard(f, file.block_rows)):
                if n:
                    sizes.append(n)
                    where_block.append((f, i, row))
                row += n
        self.block_sizes = tuple(sizes)
        self._where_block = where_block
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            raise DataError(f"data.source: {source!r} has no rows")

    # ---- opening

    @staticmethod
    def _filesystem(source: str) -> tuple[pafs.FileSystem, str]:
        if "://" in source:
            try:
                return pafs.FileSystem.from_uri(source)
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"data.source: cannot read {source!r} ({_reason(e)})") from None
        return pafs.LocalFileSystem(), os.path.abspath(source)

    @staticmethod
    def _is_ipc(fs: pafs.FileSystem, base: str, info: pafs.FileInfo) -> bool:
        if info.type != pafs.FileType.Directory:
            return base.lower().endswith(_IPC_SUFFIXES)
        names = [i.path for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
                 if i.type == pafs.FileType.File and not _hidden(i.path[len(base):])]
        kinds = {n.lower().endswith(_IPC_SUFFIXES) for n in names}
        if len(kinds) > 1:
            ipc_name = next(n for n in names if n.lower().endswith(_IPC_SUFFIXES))
            other = next(n for n in names if not n.lower().endswith(_IPC_SUFFIXES))
            raise DataError(f"data.source: {base!r} mixes Arrow IPC and Parquet files "
                            f"({os.path.basename(ipc_name)}, {os.path.basename(other)})")
        return kinds == {True}

    def _schemas(self) -> pa.Schema:
        first = None
        for f, file in enumerate(self._files):
            schema = self._guard(f, file.schema)
            if f >= _OPEN_FILES:  # keep only the first few handles until blocks are counted
                file.close()
            if first is None:
                first = schema
            elif not schema.equals(first, check_metadata=False):
                raise DataError(f"data.source: {self._name(f)!r} and {self._name(0)!r} have different schemas "
                                f"({_schema_difference(schema, first)})")
        return first

    def _chosen_columns(self, schema: pa.Schema, columns: Sequence[str] | None) -> tuple[str, ...]:
        if columns is None:
            return tuple(schema.names)
        chosen = tuple(dict.fromkeys([columns] if isinstance(columns, str) else columns))
        if not chosen:
            raise DataError(f"data.column: no columns asked of {self._name(0)!r} (it has: {', '.join(schema.names)})")
        for c in chosen:
            if c not in schema.names:
                raise DataError(f"data.column: {c!r} is not a column of {self._name(0)!r} "
                                f"(it has: {', '.join(schema.names)})")
        return chosen

    def _name(self, f: int) -> str:
        """A file as the user named it: the source, plus the path below it for a directory."""
        if not self._is_dir:
            return self.source
        return self.source.rstrip("/") + "/" + self._files[f].path[len(self._base):].lstrip("/")

    def _guard(self, f: int, call, what: str = ""):
        try:
            return call()
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.source: cannot read {self._name(f)!r}{what} ({_reason(e)})") from None

    def _use(self, f: int) -> _File:
        """File f with its reader open; the least recently used one beyond _OPEN_FILES is closed."""
        file = self._files[f]
        if f in self._open:
            self._open.move_to_end(f)
        else:
            self._guard(f, lambda: file.open(self._fields))
            self._open[f] = file
            while len(self._open) > _OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        return file

    # ---- reading

    def _block(self, b: int) -> pa.Table:
        if b in self._cache:
            self._cache.move_to_end(b)
            return self._cache[b]
        f, i, _ = self._where_block[b]
        file = self._use(f)
        table = self._guard(f, lambda: file.read(i, list(self.columns)), f" block {i}")
        self.blocks_read += 1
        if self.cache_blocks:
            self._cache[b] = table
            while len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)
        return table

    def _check(self, idx: np.ndarray) -> None:
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            bad = int(idx[(idx < 0) | (idx >= self.num_samples)][0])
            raise IndexError(f"sample index {bad} is out of range: {self.source!r} has {self.num_samples} samples")

    def rows(self, indices: Sequence[int]) -> pa.Table:
        """Those rows, in the order asked (repeats allowed), with only `columns`."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._check(idx)
        if idx.size == 0:
            return self._schema.empty_table()
        blocks = np.searchsorted(self._starts, idx, side="right") - 1
        local = idx - self._starts[blocks]
        # each block is read once per call whatever the cache size
        groups = {int(b): np.flatnonzero(blocks == b) for b in np.unique(blocks)}
        tables = {b: self._block(b) for b in groups}
        arrays = [self._gather(c, tables, groups, local) for c in range(len(self.columns))]
        return pa.Table.from_arrays(arrays, schema=self._schema)

    def _gather(self, c: int, tables: dict, groups: dict, local: np.ndarray) -> pa.Array:
        """Column c of the asked rows. A list column of numbers without nulls (token ids: the usual
        case) is gathered with numpy from the block's buffers, which are memory-mapped for local
        IPC files: Arrow's take copies a list value by value, which made it most of a read."""
        field = self._schema.field(c)
        flat = {b: _flat_list(tables[b].column(c)) for b in groups}
        if not all(v is not None for v in flat.values()):
            pieces = [(rows, tables[b].column(c).take(pa.array(local[rows]))) for b, rows in groups.items()]
            return _in_order(pieces, local.size)
        n = local.size
        lengths = np.empty(n, dtype=np.int64)
        for b, rows in groups.items():
            offsets = flat[b][0]
            lengths[rows] = offsets[local[rows] + 1] - offsets[local[rows]]
        out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=out_offsets[1:])
        values = np.empty(int(out_offsets[-1]), dtype=next(iter(flat.values()))[1].dtype)
        if (lengths == lengths[0]).all():  # rows of one length: whole rows by fancy indexing
            width = int(lengths[0])
            matrix = values.reshape(n, width)
            for b, rows in groups.items():
                offsets, data = flat[b]
                span = data[offsets[0] : offsets[-1]]
                if span.size == width * (offsets.size - 1) and (np.diff(offsets) == width).all():
                    matrix[rows] = span.reshape(-1, width)[local[rows]]  # a block of one row length
                else:
                    starts = offsets[local[rows]]
                    matrix[rows] = data[starts[:, None] + np.arange(width)]
        else:
            for b, rows in groups.items():
                offsets, data = flat[b]
                for r in rows:
                    values[out_offsets[r] : out_offsets[r + 1]] = data[offsets[local[r]] : offsets[local[r] + 1]]
        list_type = field.type
        offsets_array = pa.array(out_offsets.astype(np.int64 if pa.types.is_large_list(list_type) else np.int32))
        cls = pa.LargeListArray if pa.types.is_large_list(list_type) else pa.ListArray
        return cls.from_arrays(offsets_array, pa.array(values, type=list_type.value_type), type=list_type)

    def where(self, index: int) -> str:
        """Where sample `index` lives, for error messages: "<file> row <row within the file>"."""
        self._check(np.asarray([index], dtype=np.int64))
        b = int(np.searchsorted(self._starts, index, side="right") - 1)
        f, _, first = self._where_block[b]
        return f"{self._name(f)} row {first + index - int(self._starts[b])}"


def _flat_list(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets, values) of a list column of numbers without nulls, as numpy views; else None."""
    t = column.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
            pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        return None
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if array.null_count or array.values.null_count:
        return None
    return array.offsets.to_numpy(), array.values.to_numpy(zero_copy_only=False)


def _in_order(pieces: list[tuple[np.ndarray, pa.Array]], n: int) -> pa.Array:
    """The gathered pieces (rows they answer, their values) as one array in the order asked."""
    if len(pieces) == 1 and np.array_equal(pieces[0][0], np.arange(n)):
        return pieces[0][1].combine_chunks() if isinstance(pieces[0][1], pa.ChunkedArray) else pieces[0][1]
    order = np.concatenate([rows for rows, _ in pieces])
    gathered = pa.concat_arrays([a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for _, a in pieces])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return gathered.take(pa.array(inverse))
