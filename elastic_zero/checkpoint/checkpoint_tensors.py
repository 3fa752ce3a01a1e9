"""One of our committed checkpoints as weights to start from (`model.init_from`), read lazily.

Its trained parameters by name (a tied parameter under each of its names), then what the final save
kept beside the shards (buffers, frozen parameters). A tensor is read when asked for, or a flat range
of it (`read_flat`): a ZeRO-3 rank that starts from a checkpoint reads only the blocks that overlap
its shard, so a job of N ranks reads the model about once, not N times.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint.export import MODEL_TENSORS_KEY
from elastic_zero.checkpoint.safetensors_format import LazyTensors
from elastic_zero.checkpoint.store import BlockReader, read_manifest
from elastic_zero.plan.layout import FlatLayout


class CheckpointTensors(Mapping):
    """The model's tensors in a checkpoint directory, by name. `bytes_read` counts the bytes read."""

    def __init__(self, fs: pafs.FileSystem, directory: str) -> None:
        self._manifest = read_manifest(fs, directory)
        self._reader = BlockReader(fs, directory, self._manifest)
        self._slots = {s.name: s for s in FlatLayout.from_dict(self._manifest.layout).slots}
        aliases = self._manifest.extra.get("aliases", {})
        self._slot_of = {**{name: name for name in self._slots}, **dict(aliases)}
        side = self._manifest.extra.get(MODEL_TENSORS_KEY)
        self._side = LazyTensors(fs, [f"{directory}/{side}"]) if side else None
        self.shapes = {name: tuple(self._slots[of].shape) for name, of in self._slot_of.items()}
        if self._side is not None:
            self.shapes.update(self._side.shapes)

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read + (self._side.bytes_read if self._side is not None else 0)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._slot_of:
            slot = self._slots[self._slot_of[name]]
            return self.read_flat(name, 0, slot.numel).view(slot.shape)
        if self._side is not None and name in self._side:
            return self._side[name]
        raise KeyError(name)

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `name` flattened, in fp32."""
        if name not in self._slot_of:
            if self._side is not None and name in self._side:
                return self._side.read_flat(name, lo, hi)
            raise KeyError(name)
        slot = self._slots[self._slot_of[name]]
        if not 0 <= lo <= hi <= slot.numel:
            raise ValueError(f"elements [{lo}, {hi}) are outside parameter {name!r} of {slot.numel}")
        out = torch.empty(hi - lo, dtype=torch.float32)
        if hi > lo:
            self._reader.read("params", slot.offset + lo, slot.offset + hi, out)
        return out

    def fingerprint(self) -> str:
        """What every rank must read alike: the manifest (its layout and every block's CRC)."""
        return json.dumps(self._manifest.to_dict(), sort_keys=True)

    def __contains__(self, name) -> bool:  # (Mapping's own would read the tensor)
        return name in self._slot_of or (self._side is not None and name in self._side)

    def __iter__(self):
        yield from self._slot_of
        if self._side is not None:
            yield from self._side

    def __len__(self) -> int:
        return len(self._slot_of) + (len(self._side) if self._side is not None else 0)
