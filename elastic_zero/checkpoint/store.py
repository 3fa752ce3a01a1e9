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
from elastic_zero.checkpoint.block_reads import (  # noqa: F401 - ChecksumError and BlockReader are this module's API too
    BIT_VIEWS, TORCH_DTYPES, BlockReader, ChecksumError, read_ranges,
)
from elastic_zero.checkpoint.manifest import Block, DataFile, Manifest, Segment, plan_blocks
from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero.shard import ShardState

BLOCK_NUMEL = 1 << 20


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (a host tensor: the snapshot's own memory, not a copy). A copy into a bytes
    object would hold the GIL while it runs, and a save writes from a thread beside the training
    one: the stream's write and zlib's CRC take this view with the GIL released."""
    t = t.detach().contiguous().cpu()
    if sys.byteorder != "little":  # the format is little-endian
        raise RuntimeError("big-endian hosts are not supported by the checkpoint format")
    return memoryview(t.view(BIT_VIEWS[t.element_size()]).numpy()).cast("B")


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
                    offset += data.nbytes
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
    vectors, wanted = {}, []
    for name in names:
        vectors[name] = out = torch.empty(numel, dtype=TORCH_DTYPES[manifest.vectors[name]])
        cursor = 0
        for r in ranges:
            if r.numel:
                wanted.append((name, r.start, r.stop, out[cursor : cursor + r.numel]))
            cursor += r.numel
    read_ranges(fs, directory, manifest, wanted)
    return ShardState(layout, partition, rank, vectors, dict(manifest.scalars))


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
