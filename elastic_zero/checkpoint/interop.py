"""Plain PyTorch state dicts in and out of sharded checkpoints."""

from __future__ import annotations

import fnmatch
import io
import json
import os
import zipfile
from typing import Iterable, Mapping, Sequence

import pyarrow.fs as pafs
import torch

from elastic_zero.checkpoint.checkpoint_tensors import CheckpointTensors
from elastic_zero.checkpoint.export import iter_params
from elastic_zero.checkpoint.safetensors_format import LazyTensors
from elastic_zero.checkpoint.store import MANIFEST, list_checkpoints, resolve
from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero.shard import ShardState


def export_state_dict(fs: pafs.FileSystem, directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 parameters as {name: tensor}, loadable with torch.load(weights_only=True):
    read a parameter at a time (export.py), so the model is held once."""
    return dict(iter_params(fs, directory))


def shards_from_state_dict(state_dict: Mapping[str, torch.Tensor], layout: FlatLayout, world_size: int,
                           vector_names: Sequence[str], step: int = 0) -> list[ShardState]:
    """Every rank's shard for `layout` from plain weights (optimizer state zero), e.g. pretrained ones."""
    missing = [s.name for s in layout.slots if s.name not in state_dict]
    wrong = [f"{s.name}: {tuple(state_dict[s.name].shape)} vs {s.shape}" for s in layout.slots
             if s.name in state_dict and tuple(state_dict[s.name].shape) != s.shape]
    if missing or wrong:
        raise ValueError(f"state dict does not fit the model: missing {missing[:3]}, shapes {wrong[:3]}")
    flat = torch.zeros(layout.total)
    for s in layout.slots:
        flat[s.offset : s.end] = state_dict[s.name].detach().float().reshape(-1)
    partition = partition_layout(layout, world_size)
    out = []
    for rank in range(world_size):
        params = torch.cat([flat[r.start : r.stop] for r in partition.ranges(rank)])
        vectors = {n: (params if n == "params" else torch.zeros_like(params)) for n in vector_names}
        out.append(ShardState(layout, partition, rank, vectors, {"step": step}))
    return out


def load_initial_weights(uri: str, field: str = "model.init_from") -> Mapping[str, torch.Tensor]:
    """Weights to start from: a torch.save'd state dict (read with weights_only=True), a safetensors
    file, a Hugging Face model directory (model.safetensors, or shards with model.safetensors.index.json),
    one of our checkpoint directories, or a checkpoint root (its latest commit). A path or URI.
    Safetensors and checkpoints are read a tensor at a time, as they are asked for, or a range at a
    time where the mapping has `read_flat` (a ZeRO-3 rank reads its shard's part only); a local
    torch.save'd file is mapped (_load_state_dict)."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
        info = fs.get_file_info(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{field}: cannot open {uri!r} ({exc})") from None
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"{field}: no such file or directory: {uri!r}")
    try:
        if info.type == pafs.FileType.Directory and _is_file(fs, f"{path}/config.json"):
            return LazyTensors(fs, _hugging_face_files(fs, path))
        if path.endswith(".safetensors"):
            return LazyTensors(fs, [path])
        if info.type == pafs.FileType.Directory:
            if fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.NotFound:
                if not list_checkpoints(fs, path):
                    raise ValueError(f"{uri!r} is a directory with no committed checkpoint")
                path = resolve(fs, path, "latest")
            return CheckpointTensors(fs, path)
        state = _load_state_dict(fs, path)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - an unreadable file, whatever torch.load raises
        raise ValueError(f"{field}: cannot read {uri!r} as a state dict ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{field}: {uri!r} does not hold a state dict of tensors")
    return dict(state)


def _load_state_dict(fs: pafs.FileSystem, path: str):
    """A torch.save'd file: a local one mapped (its tensors read as they are touched: a joiner's
    skeleton touches none, a meta model's engine a unit at a time, and no copy of the whole file is
    held beside them), else read whole. A file of torch's legacy format (torch.save's is a zip
    archive since torch 1.6) cannot be mapped: read whole."""
    if isinstance(fs, pafs.LocalFileSystem) and zipfile.is_zipfile(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    with fs.open_input_stream(path) as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def _hugging_face_files(fs: pafs.FileSystem, directory: str) -> list[str]:
    """The safetensors files of a Hugging Face model directory."""
    if _is_file(fs, f"{directory}/model.safetensors"):
        return [f"{directory}/model.safetensors"]
    index = f"{directory}/model.safetensors.index.json"
    if not _is_file(fs, index):
        raise ValueError(f"{directory}: a Hugging Face directory with neither model.safetensors nor "
                         f"model.safetensors.index.json (only safetensors weights are read)")
    with fs.open_input_stream(index) as f:
        weight_map = json.loads(f.read())["weight_map"]
    return [f"{directory}/{name}" for name in sorted(set(weight_map.values()))]


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor], field: str = "model.init_from",
              new_params: Sequence[str] = ()) -> None:
    """Copy `state` into `model`; every parameter must be there with its shape (buffers may be absent),
    but for those named by the patterns `new_params`, which keep their values where `state` lacks them.
    A tensor at a time: a lazy `state` (a file's tensors) is never held whole beside the model."""
    check_fits(model, state, field, new_params)
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            if name in state:
                target.copy_(state[name])


def new_parameter_names(names: Iterable[str], patterns: Sequence[str]) -> set[str]:
    """The parameter names that the glob patterns (`model.new_params`) match; a pattern that matches
    none is a ValueError naming it (a typo would otherwise surface as a missing weight, or not at all)."""
    names = sorted(names)
    matched: set[str] = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            example = f" (one of its names: {names[0]!r})" if names else ""
            raise ValueError(f"model.new_params: {pattern!r} matches no parameter of the model{example}")
        matched |= hits
    return matched


def check_fits(model: torch.nn.Module, state: Mapping[str, torch.Tensor], field: str = "model.init_from",
               new_params: Sequence[str] = ()) -> None:
    """Raise ValueError naming the missing, unexpected or mis-shaped tensors unless `state` fits `model`
    (a parameter matched by a pattern of `new_params` may be missing)."""
    own = dict(model.state_dict())
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(params - set(state) - new_parameter_names(params, new_params))
    unexpected = sorted(set(state) - set(own))
    shapes = getattr(state, "shapes", None) or {k: tuple(v.shape) for k, v in state.items()}  # lazy ones: unread
    wrong = [f"{k} {tuple(shapes[k])} vs {tuple(own[k].shape)}" for k in own
             if k in shapes and tuple(shapes[k]) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
                 f"shapes {wrong[:3]}" if wrong else ""]
        raise ValueError(f"{field}: the weights do not fit the model: {'; '.join(p for p in parts if p)}")
