"""Checks of a job's inputs that can be made before Ray starts: every path the spec names, the
dataset's schema, and (on an embedded Ray, where the driver's Python is the workers') the user's
functions.

A problem is a SpecError naming the field (the CLI exits 2 with it): a missing dataset or column,
an empty one, weights to start from that are not there, a checkpoint store that cannot be written
or read, a checkpoint to resume that does not exist, a function that cannot be imported.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from elastic_zero.spec import JobSpec, SpecError


def preflight(spec: JobSpec, import_user_code: bool = True) -> int | None:
    """Raise SpecError for the first problem found; return the dataset's number of samples (None
    for synthetic data), read from its metadata on the way."""
    size = None
    if spec.data.source != "synthetic":
        _check_exists("data.source", spec.data.source)
        size = _dataset_size(spec)
    if spec.model.init_from:
        _check_exists("model.init_from", spec.model.init_from)
    if import_user_code:
        from elastic_zero.user_code import UserCodeError, resolve

        for where, ref in (("model.factory", spec.model.factory), ("train.loss", spec.train.loss),
                           ("data.collate", spec.data.collate)):
            if ref is not None:
                try:
                    resolve(where, ref)
                except UserCodeError as exc:
                    raise SpecError(str(exc)) from None
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
    return size


def _check_exists(field: str, path: str) -> None:
    try:
        fs, inner = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
        found = fs.get_file_info(inner).type != pafs.FileType.NotFound
    except (OSError, ValueError) as exc:
        raise SpecError(f"{field}: cannot open {path!r} ({exc})") from None
    if not found:
        raise SpecError(f"{field}: no such file or directory: {path!r}")



def _dataset_size(spec: JobSpec) -> int:
    """The dataset's samples, once it opens and has rows and the columns the job reads (metadata only)."""
    from elastic_zero.data.arrow_rows import DataError
    from elastic_zero.job import dataset_size

    try:
        return dataset_size(spec)
    except DataError as exc:
        raise SpecError(str(exc)) from None
