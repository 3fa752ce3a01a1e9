"""A torch state dict file written one tensor at a time: torch.save's format (a zip of the pickle
`data.pkl` and one record per storage), which torch.load(weights_only=True) reads as it reads any.

torch.save pickles the whole dict, its tensors alive, and then writes their storages: a process
exporting a model that way holds all of it (3.86 GB of RSS for a 354M model, its 1.4 GB of weights
twice). Here the pickle is made from each tensor's name, shape and dtype alone (it refers to each
storage by a key, as torch's does), and the storages follow as they are read: the process holds one
tensor at a time. A tied parameter's other names refer to the same key, as torch.save would store it.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys

import torch
import torch._utils

PICKLE_PROTOCOL = 2  # torch.save's
# a dtype's storage class as torch.save names it: torch's own table (TypedStorage._pickle_storage_type
# reads it: complex and quantized dtypes too), or the classic ones where this torch has no such table
STORAGE_CLASS = dict(getattr(torch.storage, "_dtype_to_storage_type_map", lambda: {})()) or {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage"}


class _Storage:
    """A storage to be written under `key`, as the pickle names it."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        if dtype not in STORAGE_CLASS:
            raise ValueError(f"a tensor of {dtype} cannot be written to a torch state dict file here")
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """A contiguous tensor over a whole _Storage, pickled as torch pickles a tensor."""

    def __init__(self, storage: _Storage, shape: tuple) -> None:
        self.storage, self.shape = storage, tuple(shape)

    def __reduce_ex__(self, protocol):
        strides, size = [], 1
        for dim in reversed(self.shape):
            strides.append(size)
            size *= dim
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(strides)), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):  # as torch.serialization._save names a typed storage
            return "storage", getattr(torch, STORAGE_CLASS[obj.dtype]), obj.key, "cpu", obj.numel
        return None


def write(out, entries: list[tuple], tensors, aliases: dict[str, str]) -> None:
    """Write to the binary stream `out` the state dict whose `entries` are (name, shape, dtype) in the
    order `tensors` gives (name, tensor); a name in `aliases` (alias -> name) is stored as the tensor
    it names, whose own entry comes first."""
    storages: dict[str, _Storage] = {}
    state = {}
    for name, shape, dtype in entries:
        if name in aliases:
            state[name] = state[aliases[name]]
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        storages[name] = _Storage(str(len(storages)), dtype, numel)
        state[name] = _Tensor(storages[name], shape)
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PICKLE_PROTOCOL).dump(state)
    pickled = buffer.getvalue()
    from torch.serialization import _get_storage_alignment, get_crc32_options

    writer = torch._C.PyTorchFileWriter(out, get_crc32_options(), _get_storage_alignment())
    alignment = str(_get_storage_alignment())
    for record, data in (("data.pkl", pickled), (".format_version", "1"), (".storage_alignment", alignment),
                         ("byteorder", sys.byteorder)):
        writer.write_record(record, data, len(data))
    written = 0
    for name, tensor in tensors:
        storage = storages.get(name)
        if storage is None:  # an alias: its tensor is written once, under its own name
            continue
        written += 1
        if (tensor.dtype, tensor.numel()) != (storage.dtype, storage.numel):
            raise ValueError(f"{name}: read {tensor.dtype} x {tensor.numel()}, listed as {storage.dtype} x {storage.numel}")
        tensor = tensor.contiguous()
        if tensor.storage_offset():  # its bytes do not begin its storage's: a record is a storage's first bytes
            tensor = tensor.clone()
        writer.write_record(f"data/{storage.key}", tensor.untyped_storage(), tensor.nbytes)
    if written != len(storages):
        raise ValueError(f"{len(storages) - written} of the {len(storages)} tensors listed were not given")
    writer.write_end_of_file()
