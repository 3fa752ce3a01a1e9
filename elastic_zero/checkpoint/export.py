"""A checkpoint's weights out, one tensor at a time: a torch state dict, a safetensors file, or a
Hugging Face model directory (config.json and safetensors files, sharded with an index past
`max_shard_bytes`).

A checkpoint's files hold flat ranges of every rank; a tensor is read by the blocks that overlap
it (each checked by its CRC), so every writer (safetensors, Hugging Face, a torch file:
torch_format.py) holds at most one tensor and one block at a time, whatever the model's size. Only
a state dict in this process's memory (load_state_dict) holds the whole model, and is refused above
STATE_DICT_LIMIT_BYTES. Every output is written under a temporary name and renamed when whole, so an
interrupted export leaves nothing half-written.

Tied parameters (a shared embedding and LM head) are stored once; the manifest names their other
names (`aliases`), and every format writes them under each name. A Hugging Face model's config is
in the manifest too (`hf_config`), saved by the workers that trained it.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint import safetensors_format, torch_format
from elastic_zero.checkpoint.store import MANIFEST, BlockReader, list_checkpoints, open_store, read_manifest, resolve
from elastic_zero.plan.layout import FlatLayout

STATE_DICT_LIMIT_BYTES = 4 << 30  # the most a state dict in the driver's memory may hold (fp32 bytes)
HF_SHARD_BYTES = 5 << 30  # Hugging Face's default shard size
FORMATS = ("safetensors", "hf", "torch")
MODEL_TENSORS_KEY = "model_tensors"  # the manifest's name for the file of the final save's buffers and frozen parameters
MODEL_TENSORS_FILE = "model-tensors.safetensors"


def model_extra(model: torch.nn.Module) -> dict:
    """What a checkpoint records of its model beyond the layout: the other names of tied parameters
    and, for a Hugging Face model, its config (what `export --format hf` writes as config.json)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    extra: dict = {"aliases": aliases}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
        hf_config = config.to_dict()
        hf_config["architectures"] = [type(model).__name__]
        extra["hf_config"] = hf_config
    return extra


def open_checkpoint(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, directory) of a checkpoint: a step directory, or a root (its latest commit)."""
    fs, path = open_store(uri)
    if fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File:
        return fs, path
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        raise ValueError(f"{uri}: no such checkpoint")
    if not list_checkpoints(fs, path):
        raise ValueError(f"{uri}: neither a committed checkpoint nor a directory of them")
    return fs, resolve(fs, path, "latest")


def iter_weights(fs: pafs.FileSystem, directory: str, scratch: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the model's state dict the checkpoint holds: the trained
    parameters (fp32) in the layout's order, a tied parameter's other names right after it (views of
    the same tensor), then what the job saved beside its shards with the final weights (buffers,
    frozen parameters: `model_tensors`). `scratch`: as iter_params's."""
    manifest = read_manifest(fs, directory)
    aliases_of = _aliases_of(manifest)
    for name, tensor in iter_params(fs, directory, manifest, scratch):
        yield name, tensor
        for alias in aliases_of.get(name, ()):
            yield alias, tensor
    side = manifest.extra.get(MODEL_TENSORS_KEY)
    if side:
        yield from safetensors_format.read(fs, f"{directory}/{side}")


def iter_params(fs: pafs.FileSystem, directory: str, manifest=None,
                scratch: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor of its own) of every trained parameter, in the layout's order, each read
    from the blocks that overlap it. With `scratch`, each tensor is instead a view of one buffer (the
    size of the largest), valid until the next is read: a writer that takes one tensor at a time
    then holds one, where a new tensor each would leave the allocator's heap as high as several."""
    manifest = manifest or read_manifest(fs, directory)
    slots = FlatLayout.from_dict(manifest.layout).slots
    buffer = torch.empty(max((s.numel for s in slots), default=0) if scratch else 0, dtype=torch.float32)
    with BlockReader(fs, directory, manifest) as reader:
        for slot in slots:
            out = buffer[:slot.numel] if scratch else torch.empty(slot.numel, dtype=torch.float32)
            reader.read("params", slot.offset, slot.end, out)
            yield slot.name, out.view(slot.shape)


def _aliases_of(manifest) -> dict[str, list[str]]:
    aliases_of: dict[str, list[str]] = {}
    for alias, name in manifest.extra.get("aliases", {}).items():
        aliases_of.setdefault(name, []).append(alias)
    return aliases_of


def _entries(fs: pafs.FileSystem, directory: str) -> list[tuple]:
    """(name, shape, dtype) of every tensor iter_weights gives, in its order, without reading them."""
    manifest = read_manifest(fs, directory)
    layout = FlatLayout.from_dict(manifest.layout)
    aliases_of = _aliases_of(manifest)
    out = []
    for slot in layout.slots:
        out.append((slot.name, tuple(slot.shape), torch.float32))
        out.extend((alias, tuple(slot.shape), torch.float32) for alias in aliases_of.get(slot.name, ()))
    side = manifest.extra.get(MODEL_TENSORS_KEY)
    if side:
        out.extend(safetensors_format.entries(fs, f"{directory}/{side}"))
    return out


def _nbytes(entry) -> int:
    _, shape, dtype = entry
    n = torch.empty(0, dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def load_state_dict(uri: str, limit_bytes: int = STATE_DICT_LIMIT_BYTES) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a state dict in this process's memory, if they fit `limit_bytes`
    (a tied parameter counted once)."""
    fs, directory = open_checkpoint(uri)
    aliases = read_manifest(fs, directory).extra.get("aliases", {})
    nbytes = sum(_nbytes(e) for e in _entries(fs, directory) if e[0] not in aliases)
    if nbytes > limit_bytes:
        raise ValueError(f"the weights at {uri} are {nbytes / 2**30:.1f} GiB, over the {limit_bytes / 2**30:.1f} GiB "
                         f"a state dict may hold in memory: export them instead "
                         f"(elastic-zero export {uri} OUT --format safetensors|hf)")
    return {name: t.clone() for name, t in iter_weights(fs, directory, scratch=True)}


def export(checkpoint_uri: str, out_uri: str, fmt: str, max_shard_bytes: int = HF_SHARD_BYTES) -> list[str]:
    """Write the checkpoint's weights to `out_uri` in `fmt` (see FORMATS); returns the paths written."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: got {fmt!r}; allowed: {', '.join(FORMATS)}")
    fs, directory = open_checkpoint(checkpoint_uri)
    out_fs, out_path = _output(out_uri, directory=fmt == "hf")
    if fmt == "torch":
        entries, aliases = _entries(fs, directory), read_manifest(fs, directory).extra.get("aliases", {})
        return [_atomically(out_fs, out_path, lambda tmp: _torch_write(
            out_fs, tmp, entries, iter_weights(fs, directory, scratch=True), aliases))]
    if fmt == "safetensors":
        entries = _entries(fs, directory)
        return [_atomically(out_fs, out_path, lambda tmp: safetensors_format.write(
            out_fs, tmp, entries, iter_weights(fs, directory, scratch=True)))]
    config = read_manifest(fs, directory).extra.get("hf_config")
    if config is None:
        raise ValueError(f"{checkpoint_uri}: the job's model is not a Hugging Face model (its checkpoint has no "
                         f"config): export it as safetensors or torch")
    return [_atomically(out_fs, out_path, lambda tmp: _write_hf(out_fs, tmp, config, fs, directory, max_shard_bytes),
                        directory=True)]


def _output(uri: str, directory: bool) -> tuple[pafs.FileSystem, str]:
    """The output's filesystem and path: a file may be replaced (by a rename, when the new one is
    whole), a directory is never written into."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{uri}: cannot open ({exc})") from None
    parent = os.path.dirname(path.rstrip("/"))
    existing = fs.get_file_info(path).type
    if existing == pafs.FileType.Directory or (directory and existing != pafs.FileType.NotFound):
        raise ValueError(f"{uri}: exists already; export writes a new directory")
    if parent and fs.get_file_info(parent).type != pafs.FileType.Directory:
        raise ValueError(f"{uri}: its directory {parent} does not exist")
    return fs, path.rstrip("/")


def _atomically(fs: pafs.FileSystem, path: str, write, directory: bool = False) -> str:
    """Write through `write(temporary path)`, then rename to `path`; on failure remove the temporary."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp-{os.getpid()}"
    try:
        if directory:
            fs.create_dir(tmp, recursive=True)
        write(tmp)
        fs.move(tmp, path)
    except BaseException:
        try:
            (fs.delete_dir if directory else fs.delete_file)(tmp)
        except OSError:  # the caller needs the first error, not this one; the leftover has a dot-name
            pass
        raise
    return path


def _torch_write(fs: pafs.FileSystem, path: str, entries: list, tensors, aliases: dict) -> None:
    with fs.open_output_stream(path) as out:
        torch_format.write(out, entries, tensors, aliases)


def _write_hf(fs: pafs.FileSystem, path: str, config: dict, src_fs, directory: str, max_shard_bytes: int) -> None:
    """A directory from_pretrained loads: config.json, and model.safetensors or, past
    `max_shard_bytes`, model-0000i-of-0000n.safetensors with model.safetensors.index.json."""
    with fs.open_output_stream(f"{path}/config.json") as out:
        out.write(json.dumps(config, indent=2, sort_keys=True).encode())
    entries = _entries(src_fs, directory)
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + _nbytes(entry) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += _nbytes(entry)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    tensors = iter_weights(src_fs, directory, scratch=True)
    for file_name, shard in zip(names, shards):
        safetensors_format.write(fs, f"{path}/{file_name}", shard, tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(e) for e in entries)},
                 "weight_map": {e[0]: file_name for file_name, shard in zip(names, shards) for e in shard}}
        with fs.open_output_stream(f"{path}/model.safetensors.index.json") as out:
            out.write(json.dumps(index, indent=2, sort_keys=True).encode())
