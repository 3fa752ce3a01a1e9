"""Checks of a job's inputs that can be made before Ray starts: every path the spec names.

A problem is a SpecError naming the field (the CLI exits 2 with it): a missing dataset, a
checkpoint store that cannot be written or read, a checkpoint to resume that does not exist.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from elastic_zero.spec import JobSpec, SpecError


def preflight(spec: JobSpec) -> None:
    if spec.data.source != "synthetic":
        _check_exists("data.source", spec.data.source)
    c = spec.checkpoint
    if c.uri and c.every:
        from elastic_zero.checkpoint import probe_writable

        probe_writable(c.uri)  # StoreError names checkpoint.uri
    if c.uri and c.resume:
        from elastic_zero.checkpoint import list_checkpoints, open_store, resolve

        fs, root = open_store(c.uri)
        committed = list_checkpoints(fs, root)  # an unreadable store is an error, never "no checkpoint"
        if c.resume != "latest" and resolve(fs, root, c.resume) not in [d for _, d in committed]:
            raise SpecError(f"checkpoint.resume: no committed checkpoint {c.resume!r} under {c.uri!r}")


def _check_exists(field: str, path: str) -> None:
    try:
        fs, inner = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
        found = fs.get_file_info(inner).type != pafs.FileType.NotFound
    except (OSError, ValueError) as exc:
        raise SpecError(f"{field}: cannot open {path!r} ({exc})") from None
    if not found:
        raise SpecError(f"{field}: no such file or directory: {path!r}")

