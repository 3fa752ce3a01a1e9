"""Sharded checkpoints on pyarrow.fs: local paths, s3://, gs://, hdfs:// (whatever from_uri knows).

    ROOT/step-0000000040/rank-00000.bin ...   one file per saving rank (written first)
    ROOT/step-0000000040/manifest.json        written last: the commit
    ROOT/step-0000000040-1/...                the same step saved again after a replay or a resume
                                              from an older step: a committed directory is immutable
    ROOT/latest                               the newest commit's directory, updated after it

Readers see only directories with a manifest. Checkpoints are ordered by commit (the manifest's
time), not by step: after a resume from an older step the newest commit may have a lower step.
A reader at any world size fetches just the blocks that overlap its ranges and checks each
block's CRC-32.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import zlib
from typing import Sequence

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint.catalog import (  # noqa: F401 - the catalog's names are this module's API too
    LATEST, MANIFEST, StoreError, _is_file, free_step_dir, list_checkpoints, open_store, probe_writable, read_manifest,
    resolve, restore_candidates, step_dir,
)
from elastic_zero.checkpoint.manifest import DTYPE_SIZES, Block, DataFile, Manifest, Segment, blocks_to_read, plan_blocks
from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero.shard import ShardState

BLOCK_NUMEL = 1 << 20
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
_BIT_VIEWS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumError(ValueError):
    pass


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if sys.byteorder != "little":  # the format is little-endian
        raise RuntimeError("big-endian hosts are not supported by the checkpoint format")
    return t.view(_BIT_VIEWS[t.element_size()]).numpy().tobytes()


def write_rank_file(fs: pafs.FileSystem, directory: str, state: ShardState,
                    block_numel: int = BLOCK_NUMEL, tag: str = "") -> DataFile:
    """Write one rank's ranges of every vector; return its entry for the manifest. `tag` makes the
    file's name unique to one save, so that a slow abandoned save of the same step never writes
    over the file of a later one."""
    name = f"{tag + '-' if tag else ''}rank-{state.rank:05d}.bin"
    fs.create_dir(directory, recursive=True)
    offset, segments = 0, []
    with fs.open_output_stream(f"{directory}/{name}") as out:
        for vector in sorted(state.vectors):
            values = state.vectors[vector]
            cursor = 0
            for r in state.ranges:
                blocks = []
                for o, n in plan_blocks(r.numel, block_numel):
                    data = _raw_bytes(values[cursor + o : cursor + o + n])
                    out.write(data)
                    blocks.append(Block(r.start + o, n, offset, zlib.crc32(data)))
                    offset += len(data)
                cursor += r.numel
                if blocks:
                    segments.append(Segment(vector, r.start, r.stop, tuple(blocks)))
    _fsync_local(fs, f"{directory}/{name}")  # on disk before any manifest can name it
    return DataFile(name, state.rank, offset, tuple(segments))


def _local_path(fs: pafs.FileSystem, path: str) -> str | None:
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return os.path.join(fs.base_path, path.lstrip("/"))
    return None  # object stores persist a completed put themselves


def _fsync_local(fs: pafs.FileSystem, path: str) -> None:
    local = _local_path(fs, path)
    if local is None:
        return
    fd = os.open(local, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(fs: pafs.FileSystem, root: str, manifest: Manifest, keep: int | None = None,
           directory: str | None = None) -> str:
    """Write the manifest (the commit), then the latest pointer, then prune to the `keep` newest
    commits (never the one just made). `directory` defaults to the step's first free one."""
    directory = directory or free_step_dir(fs, root, manifest.step)
    if _is_file(fs, f"{directory}/{MANIFEST}"):
        raise StoreError(f"{directory}: already committed; a committed checkpoint is never rewritten")
    _write_atomically(fs, f"{directory}/{MANIFEST}", json.dumps(manifest.to_dict()).encode())
    _write_atomically(fs, f"{root}/{LATEST}", os.path.basename(directory).encode())
    if keep is not None:
        for _, old in [c for c in list_checkpoints(fs, root) if c[1] != directory][: -keep + 1 or None]:
            fs.delete_dir(old)
    return directory


def _write_atomically(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    if _local_path(fs, path) is not None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        _fsync_local(fs, tmp)
        fs.move(tmp, path)  # a rename: readers see the old or the new file, never half of one
        _fsync_local(fs, os.path.dirname(path))  # and the rename itself survives a crash
    else:  # object stores make a single put visible whole
        with fs.open_output_stream(path) as out:
            out.write(data)


def save(uri: str, states: Sequence[ShardState], stage: int, extra: dict | None = None, keep: int | None = None,
         filesystem: pafs.FileSystem | None = None, block_numel: int = BLOCK_NUMEL) -> str:
    """Save every rank's shard from one process (each rank may instead call write_rank_file itself)."""
    fs, root = open_store(uri, filesystem)
    first = states[0]
    step = int(first.scalars["step"])
    directory = free_step_dir(fs, root, step)
    files = tuple(write_rank_file(fs, directory, s, block_numel) for s in sorted(states, key=lambda s: s.rank))
    manifest = make_manifest(first, files, stage, extra)
    return commit(fs, root, manifest, keep, directory)


def make_manifest(state: ShardState, files: Sequence[DataFile], stage: int, extra: dict | None = None) -> Manifest:
    dtypes = {name: str(v.dtype).replace("torch.", "") for name, v in state.vectors.items()}
    return Manifest(int(state.scalars["step"]), state.partition.world_size, stage, state.layout.to_dict(), dtypes,
                    tuple(files), dict(state.scalars), dict(extra or {}))


def load_shard(fs: pafs.FileSystem, directory: str, layout: FlatLayout, world_size: int, rank: int,
               vector_names: Sequence[str] | None = None) -> ShardState:
    """Rank `rank`'s shard of a `world_size` partition, read from a checkpoint saved at any size."""
    manifest = read_manifest(fs, directory)
    saved = FlatLayout.from_dict(manifest.layout)
    if saved != layout:
        raise ValueError(f"{directory}: checkpoint layout does not match the model: {layout.describe_mismatch(saved)}")
    names = list(vector_names) if vector_names is not None else sorted(manifest.vectors)
    missing = [n for n in names if n not in manifest.vectors]
    if missing:
        raise ValueError(f"{directory}: checkpoint lacks vectors {missing} (it has {sorted(manifest.vectors)})")
    partition = partition_layout(layout, world_size)
    ranges = partition.ranges(rank)
    numel = sum(r.numel for r in ranges)
    vectors = {}
    with BlockReader(fs, directory, manifest) as reader:
        for name in names:
            out = torch.empty(numel, dtype=_TORCH_DTYPES[manifest.vectors[name]])
            cursor = 0
            for r in ranges:
                if r.numel:
                    reader.read(name, r.start, r.stop, out[cursor : cursor + r.numel])
                cursor += r.numel
            vectors[name] = out
    return ShardState(layout, partition, rank, vectors, dict(manifest.scalars))


class BlockReader:
    """Flat ranges of a committed checkpoint's vectors, read block by block, each checked by its CRC.
    Files are opened once, and the last block read is kept: the small parameters that share a block
    cost one read of it. Every block is read into one buffer of the reader's own, so reading a
    checkpoint of any size holds one block: buffers from Arrow's pool would each be a new allocation,
    handed back to the system only after the pool's delay. `bytes_read` counts the bytes read."""

    def __init__(self, fs: pafs.FileSystem, directory: str, manifest: Manifest) -> None:
        self.fs, self.directory, self.manifest = fs, directory, manifest
        self._handles: dict[str, object] = {}
        self._last: tuple = (None, None)  # ((path, byte offset), the block's tensor: a view of _buffer)
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.bytes_read = 0

    def read(self, vector: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements [start, stop) of `vector` into `out` (converted to its dtype)."""
        dtype = self.manifest.vectors[vector]
        for f, seg, b in blocks_to_read(self.manifest, vector, start, stop):
            block = self._block(f"{self.directory}/{f.path}", vector, dtype, b)
            lo, hi = max(start, b.start), min(stop, b.start + b.numel)
            out[lo - start : hi - start].copy_(block[lo - b.start : hi - b.start])

    def _block(self, path: str, vector: str, dtype: str, b: Block) -> torch.Tensor:
        if self._last[0] == (path, b.offset):
            return self._last[1]
        if path not in self._handles:
            try:
                self._handles[path] = self.fs.open_input_file(path)
            except FileNotFoundError:
                raise ValueError(f"{path}: data file of a committed checkpoint is missing") from None
        size = DTYPE_SIZES[dtype]
        nbytes = b.numel * size
        if self._buffer.numel() < nbytes:
            self._last = (None, None)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        data = memoryview(self._buffer.numpy())[:nbytes]
        handle = self._handles[path]
        handle.seek(b.offset)
        got = handle.readinto(data)
        self.bytes_read += got
        if got != nbytes or zlib.crc32(data) != b.crc32:
            what = "truncated" if got != nbytes else "checksum mismatch"
            raise ChecksumError(f"{path}: {what} in {vector!r} elements [{b.start}, {b.start + b.numel}) "
                                f"at bytes [{b.offset}, {b.offset + nbytes})")
        block = self._buffer[:nbytes].view(_BIT_VIEWS[size]).view(_TORCH_DTYPES[dtype])
        self._last = ((path, b.offset), block)
        return block

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._last = (None, None)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_latest(fs: pafs.FileSystem, root: str, layout: FlatLayout, world_size: int, rank: int,
                vector_names: Sequence[str] | None = None) -> tuple[ShardState, str]:
    """Load the newest committed checkpoint; on a checksum error fall back to older ones, warning."""
    errors = []
    candidates = restore_candidates(fs, root)
    if not candidates:
        raise ValueError(f"{root}: no committed checkpoint")
    for directory in candidates:
        try:
            return load_shard(fs, directory, layout, world_size, rank, vector_names), directory
        except ChecksumError as exc:
            errors.append(str(exc))
            warnings.warn(f"checkpoint {directory} is damaged ({exc}); trying the previous one", stacklevel=2)
    raise ChecksumError("every committed checkpoint is damaged: " + "; ".join(errors))
