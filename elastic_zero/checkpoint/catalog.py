"""The store's catalog: a checkpoint URI opened through pyarrow.fs, its step directories, which of
them are committed and which is the latest, and a probe that the store can be written. No torch:
the driver's checks and the coordinator's start use it before any worker has started (a torch import
is a second of a small machine), so that the workers are spawned first.
"""

from __future__ import annotations

import json
import os
import re

import pyarrow.fs as pafs

from elastic_zero.checkpoint.manifest import Manifest

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d{10})(?:-(\d+))?")


class StoreError(ValueError):
    """The checkpoint store cannot be read or written: the message names the URI."""


def open_store(uri: str, filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path) for a URI or local path; `filesystem` overrides (tests, custom auth)."""
    if filesystem is not None:
        return filesystem, uri.rstrip("/")
    if "://" not in uri:
        uri = os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"checkpoint.uri: cannot open {uri!r} ({exc})") from None
    return fs, path.rstrip("/")


def step_dir(root: str, step: int, again: int = 0) -> str:
    """The directory of a save of `step`; `again` > 0 for the later saves of a committed step."""
    return f"{root}/step-{step:010d}" + (f"-{again}" if again else "")


def step_of_directory(directory: str) -> int | None:
    """The step a checkpoint directory holds, from its name (step_dir names them)."""
    match = _STEP_DIR.fullmatch(os.path.basename(directory.rstrip("/")))
    return int(match.group(1)) if match else None


def directory_uri(root_uri: str, directory: str) -> str:
    """A URI for one checkpoint directory of the store at `root_uri` (its scheme and query kept):
    what the driver, the CLI and export open later."""
    if "://" not in root_uri or root_uri.startswith("file://"):
        return directory  # an absolute local path
    root, _, query = root_uri.partition("?")
    return f"{root.rstrip('/')}/{os.path.basename(directory.rstrip('/'))}" + (f"?{query}" if query else "")


def free_step_dir(fs: pafs.FileSystem, root: str, step: int) -> str:
    """The first directory for `step` that holds no commit: committed steps are never rewritten."""
    again = 0
    while _is_file(fs, f"{step_dir(root, step, again)}/{MANIFEST}"):
        again += 1
    return step_dir(root, step, again)


def probe_writable(uri: str) -> None:
    """Raise StoreError unless a file can be written (and removed) under `uri`."""
    fs, root = open_store(uri)
    probe = f"{root}/.probe-{os.getpid()}"
    try:
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"elastic-zero")
        fs.delete_file(probe)
    except (OSError, ValueError) as exc:
        raise StoreError(f"checkpoint.uri: cannot write to {uri!r} ({exc})") from None


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def list_checkpoints(fs: pafs.FileSystem, root: str) -> list[tuple[int, str]]:
    """Committed checkpoints (those with a manifest), oldest commit first, as (step, directory).
    A root that does not exist holds none; one that cannot be read raises StoreError."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        found = []
        for info in infos:
            name = _STEP_DIR.fullmatch(os.path.basename(info.path))
            if info.type == pafs.FileType.Directory and name:
                manifest = fs.get_file_info(f"{info.path}/{MANIFEST}")
                if manifest.type == pafs.FileType.File:
                    again = int(name.group(2) or 0)
                    found.append((manifest.mtime_ns or 0, int(name.group(1)), again, info.path))
    except OSError as exc:
        raise StoreError(f"checkpoint.uri: cannot read {root!r} ({exc})") from None
    return [(step, directory) for _, step, _, directory in sorted(found)]


def committed_since(fs: pafs.FileSystem, root: str, since: float) -> list[str]:
    """The directories committed (their manifest written) at or after `since` (epoch seconds): a
    job's own commits, in a store that may hold an earlier job's too."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        manifests = [f"{i.path}/{MANIFEST}" for i in infos
                     if i.type == pafs.FileType.Directory and _STEP_DIR.fullmatch(os.path.basename(i.path))]
        return [m.path.rsplit("/", 1)[0] for m in fs.get_file_info(manifests)
                if m.type == pafs.FileType.File and (m.mtime_ns or 0) >= since * 1e9]
    except OSError as exc:
        raise StoreError(f"checkpoint.uri: cannot read {root!r} ({exc})") from None


def read_manifest(fs: pafs.FileSystem, directory: str) -> Manifest:
    path = f"{directory}/{MANIFEST}"
    try:
        with fs.open_input_stream(path) as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError(f"{path}: no manifest (not a committed checkpoint)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: manifest is not valid JSON ({exc})") from None
    return Manifest.from_dict(data, path)


def resolve(fs: pafs.FileSystem, root: str, which: str = "latest") -> str:
    """The checkpoint directory for "latest", a step number, or a step directory name."""
    if which == "latest":
        committed = list_checkpoints(fs, root)
        if not committed:
            raise ValueError(f"{root}: no committed checkpoint")
        return _latest(fs, root, committed)
    if which.isdigit():  # the newest commit of that step
        of_step = [d for s, d in list_checkpoints(fs, root) if s == int(which)]
        return of_step[-1] if of_step else step_dir(root, int(which))
    name = which[len(root):].lstrip("/") if which.startswith(root + "/") else which
    if not _STEP_DIR.fullmatch(name):  # nothing that could lead outside the root
        raise ValueError(f"checkpoint {which!r}: expected 'latest', a step number or a step directory "
                         f"name like 'step-0000000040'")
    return f"{root}/{name}"


def _latest(fs: pafs.FileSystem, root: str, committed: list[tuple[int, str]]) -> str:
    """The directory the `latest` pointer names among `committed` (non-empty), else the newest commit."""
    try:
        with fs.open_input_stream(f"{root}/{LATEST}") as f:
            pointed = f"{root}/{f.read().decode().strip()}"
        if any(d == pointed for _, d in committed):
            return pointed
    except FileNotFoundError:
        pass
    return committed[-1][1]  # the pointer lags a crash between commit and pointer update


def restore_candidates(fs: pafs.FileSystem, root: str) -> list[str]:
    """Where to restore from, in order: the latest commit, then the earlier ones, newest first;
    empty when nothing is committed. The store is listed once."""
    committed = list_checkpoints(fs, root)
    if not committed:
        return []
    latest = _latest(fs, root, committed)
    return [latest] + [d for _, d in reversed(committed) if d != latest]
