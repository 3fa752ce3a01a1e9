"""The checkpoint manifest: what was saved, where, and how to check it. Plain data (JSON).

A checkpoint is a directory with one data file per saving rank and `manifest.json`, written
last: its presence is the commit. For every state vector, each rank's file holds the rank's
ranges as raw little-endian bytes, cut into blocks of at most `block_numel` elements, each with
its own CRC-32, so that a reader can fetch and check just the blocks it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FORMAT = "elastic-zero-checkpoint"
VERSION = 1
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Block:
    start: int  # first flat element of the block
    numel: int
    offset: int  # byte offset in the file
    crc32: int


@dataclass(frozen=True)
class Segment:
    """One vector's range of one rank, as blocks in that rank's file."""

    vector: str
    start: int
    stop: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class DataFile:
    path: str  # relative to the checkpoint directory
    rank: int
    nbytes: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    stage: int
    layout: dict
    vectors: dict  # vector name -> dtype name
    files: tuple[DataFile, ...]
    scalars: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # data cursor, seed, hyperparameters, ...

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
            "stage": self.stage, "layout": self.layout, "vectors": self.vectors, "scalars": self.scalars,
            "extra": self.extra,
            "files": [datafile_to_dict(f) for f in self.files],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "manifest") -> "Manifest":
        if data.get("format") != FORMAT:
            raise ValueError(f"{where}: not an elastic_zero checkpoint manifest")
        if data.get("version") != VERSION:
            raise ValueError(f"{where}: format version {data.get('version')} is not supported (this is {VERSION})")
        try:
            files = tuple(datafile_from_dict(f) for f in data["files"])
            return cls(int(data["step"]), int(data["world_size"]), int(data["stage"]), dict(data["layout"]),
                       dict(data["vectors"]), files, dict(data.get("scalars", {})), dict(data.get("extra", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed ({exc!r})") from None


def datafile_to_dict(f: DataFile) -> dict:
    return {"path": f.path, "rank": f.rank, "nbytes": f.nbytes, "segments": [
        {"vector": s.vector, "start": s.start, "stop": s.stop,
         "blocks": [[b.start, b.numel, b.offset, b.crc32] for b in s.blocks]} for s in f.segments]}


def datafile_from_dict(f: dict) -> DataFile:
    path = str(f["path"])
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", path) or path in (".", ".."):  # a name in the directory, no more
        raise ValueError(f"data file name {path!r} is not a plain file name")
    return DataFile(path, int(f["rank"]), int(f["nbytes"]), tuple(
        Segment(str(s["vector"]), int(s["start"]), int(s["stop"]), tuple(Block(*(int(v) for v in b)) for b in s["blocks"]))
        for s in f["segments"]))


def plan_blocks(numel: int, block_numel: int) -> list[tuple[int, int]]:
    """(offset, length) blocks covering [0, numel)."""
    if block_numel < 1:
        raise ValueError(f"block_numel must be >= 1, got {block_numel}")
    return [(o, min(block_numel, numel - o)) for o in range(0, numel, block_numel)]


def blocks_to_read(manifest: Manifest, vector: str, start: int, stop: int):
    """[(file, segment, block)] whose elements intersect [start, stop) of `vector`, in flat order."""
    found = []
    for f in manifest.files:
        for seg in f.segments:
            if seg.vector != vector or seg.stop <= start or seg.start >= stop:
                continue
            for b in seg.blocks:
                if b.start < stop and b.start + b.numel > start:
                    found.append((f, seg, b))
    found.sort(key=lambda item: item[2].start)
    covered = sum(min(stop, b.start + b.numel) - max(start, b.start) for _, _, b in found)
    if covered != stop - start:
        raise ValueError(f"checkpoint holds {covered} of the {stop - start} elements [{start}, {stop}) of {vector!r}")
    return found
