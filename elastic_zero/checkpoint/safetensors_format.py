"""The safetensors file format, written as tensors come and read a tensor at a time, over pyarrow.fs:
an 8-byte little-endian header size, a JSON header (each tensor's dtype, shape and byte offsets in
the data that follows, and `__metadata__`), then the tensors' bytes in order, 8-byte aligned. Written
here rather than with the safetensors package, whose writer wants every tensor in memory at once."""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Mapping
from typing import Iterable, Iterator

import pyarrow.fs as pafs
import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_TORCH = {name: dtype for dtype, name in DTYPES.items()}

Entry = tuple  # (name, shape, torch dtype)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write(fs: pafs.FileSystem, path: str, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write `entries` (name, shape, dtype), taking each tensor from `tensors` in the same order."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
        nbytes = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with fs.open_output_stream(path) as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for (name, shape, dtype), (got, tensor) in zip(entries, tensors):
            if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise RuntimeError(f"safetensors: expected {name} {tuple(shape)} {dtype}, got {got} "
                                   f"{tuple(tensor.shape)} {tensor.dtype}")
            out.write(tensor.reshape(-1).contiguous().view(torch.uint8).numpy())  # the buffer itself, no copy


def write_all(fs: pafs.FileSystem, path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a dict of (small) tensors."""
    entries = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write(fs, path, entries, iter(tensors.items()))


def entries(fs: pafs.FileSystem, path: str) -> list[Entry]:
    """(name, shape, dtype) of every tensor in the file, in the order of their bytes."""
    with fs.open_input_file(path) as f:
        header, _ = _header(f, path)
    return _entries_of(header)


def _entries_of(header: dict) -> list[Entry]:
    return [(name, tuple(e["shape"]), _TORCH[e["dtype"]])
            for name, e in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])]


def read(fs: pafs.FileSystem, path: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the file's tensors (or of `names`), one read at a time."""
    with fs.open_input_file(path) as f:
        header, start = _header(f, path)
        for name in (names if names is not None else [n for n, _, _ in _entries_of(header)]):
            yield name, _tensor(f, path, header, start, name)


def _tensor(f, path: str, header: dict, start: int, name: str) -> torch.Tensor:
    """One tensor of an open file whose header (and where its data starts) was read."""
    e = header[name]
    return _elements(f, path, header, start, name, 0, _numel(e["shape"])).reshape(e["shape"]).clone()


def _elements(f, path: str, header: dict, start: int, name: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of tensor `name` flattened, in its own dtype, over the bytes read (read-only:
    the caller copies them out). Only those bytes are read: a tensor is row-major and contiguous."""
    e = header[name]
    begin, end = e["data_offsets"]
    dtype = _TORCH[e["dtype"]]
    if not 0 <= lo <= hi <= (end - begin) // dtype.itemsize:
        raise ValueError(f"{path}: elements [{lo}, {hi}) are outside tensor {name!r} of {(end - begin) // dtype.itemsize}")
    data = f.read_at((hi - lo) * dtype.itemsize, start + begin + lo * dtype.itemsize)
    if len(data) != (hi - lo) * dtype.itemsize:
        raise ValueError(f"{path}: truncated at tensor {name!r}")
    if hi == lo:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # read-only bytes: the callers copy them out
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


def _header(f, path: str) -> tuple[dict, int]:
    raw = f.read_at(8, 0)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (truncated)")
    (size,) = struct.unpack("<Q", raw)
    text = f.read_at(size, 8)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    return header, 8 + size


class LazyTensors(Mapping):
    """The tensors of safetensors files by name, each read when asked for (Hugging Face's sharded
    files, with their index, read as one): weights to start from, held one tensor at a time, or read
    a range at a time (`read_flat`: a ZeRO-3 rank reads only its shard's part of the model).
    `bytes_read` counts the tensor bytes read so far."""

    def __init__(self, fs: pafs.FileSystem, paths: list[str]) -> None:
        self._fs = fs
        self._file_of: dict[str, str] = {}
        self._headers: dict[str, tuple[dict, int]] = {}  # path -> (header, where its data starts), read once
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bytes_read = 0
        for path in paths:
            with fs.open_input_file(path) as f:
                self._headers[path] = _header(f, path)
            for name, shape, _ in _entries_of(self._headers[path][0]):
                self._file_of[name] = path
                self.shapes[name] = shape

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(name)
        path = self._file_of[name]
        with self._fs.open_input_file(path) as f:
            out = _tensor(f, path, *self._headers[path], name)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `name` flattened, in fp32."""
        if name not in self._file_of:
            raise KeyError(name)
        path = self._file_of[name]
        with self._fs.open_input_file(path) as f:
            raw = _elements(f, path, *self._headers[path], name, lo, hi)
        self.bytes_read += raw.numel() * raw.element_size()
        return raw.to(torch.float32, copy=True)

    def fingerprint(self) -> str:
        """What every rank must read alike: each file's header (names, shapes, dtypes, offsets)."""
        return json.dumps([self._headers[p][0] for p in sorted(self._headers)], sort_keys=True)

    def __contains__(self, name) -> bool:  # (Mapping's own would read the tensor)
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)
