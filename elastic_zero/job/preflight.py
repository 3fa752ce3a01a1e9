"""Checks of a job's inputs that can be made before Ray starts: every path the spec names, the
dataset's schema, and (on an embedded Ray, where the driver's Python is the workers') the user's
functions. Once Ray is up, check_cluster() asks of the cluster what the job cannot run without.

A problem is a SpecError naming the field (the CLI exits 2 with it): a missing dataset or column
(of the training or the eval data),
an empty one, weights to start from that are not there, a checkpoint store that cannot be written
or read, a checkpoint to resume that does not exist, a function that cannot be imported.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from elastic_zero.job.spec import JobSpec, SpecError


def preflight(spec: JobSpec, import_user_code: bool = True) -> int | None:
    """Raise SpecError for the first problem found; return the dataset's number of samples (None
    for synthetic data), read from its metadata on the way. `import_user_code`: the job runs on an
    embedded Ray, whose workers share this Python (its user code, its torch and devices)."""
    size = None
    if spec.data.source != "synthetic":
        _check_exists("data.source", spec.data.source)
        size = _dataset_size(spec, spec.data.source)
    if spec.eval.source not in (None, "synthetic"):  # read as the training data is: the same columns
        _check_exists("eval.source", spec.eval.source)
        _dataset_size(spec, spec.eval.source, "eval.source")
    if spec.model.init_from:
        _check_exists("model.init_from", spec.model.init_from)
    if import_user_code and spec.elastic.use_gpu and not _ray_connected():  # an embedded Ray: its workers' torch is this one
        import torch

        if not torch.cuda.is_available():
            raise SpecError(f"elastic.use_gpu: true needs GPUs, but this machine has none torch can use "
                            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); set elastic.use_gpu = false")
    if import_user_code:
        from elastic_zero.job.user_code import UserCodeError, resolve
        from elastic_zero.observe.tracking import missing_extra

        for backend in spec.tracking.backends:  # the coordinator tracks: on an embedded Ray its Python is this one
            if (problem := missing_extra(backend)) is not None:
                raise SpecError(problem)

        for where, ref in spec.user_functions():
            if ref is not None:
                try:
                    resolve(where, ref)
                except UserCodeError as exc:
                    raise SpecError(str(exc)) from None
    c = spec.checkpoint
    if c.uri:  # every job writes its final weights there
        from elastic_zero.checkpoint import probe_writable

        probe_writable(c.uri)  # StoreError names checkpoint.uri
    if c.uri and c.resume:
        from elastic_zero.checkpoint import list_checkpoints, open_store, resolve

        fs, root = open_store(c.uri)
        committed = list_checkpoints(fs, root)  # an unreadable store is an error, never "no checkpoint"
        if c.resume != "latest" and resolve(fs, root, c.resume) not in [d for _, d in committed]:
            raise SpecError(f"checkpoint.resume: no committed checkpoint {c.resume!r} under {c.uri!r}")
    return size


def check_cluster(spec: JobSpec, resources: dict) -> None:
    """Raise SpecError if the Ray cluster (its `ray.cluster_resources()`) cannot run `spec` at all."""
    if spec.elastic.use_gpu and resources.get("GPU", 0) < 1:
        has = ", ".join(f"{resources[k]:g} {k}" for k in ("CPU", "GPU", "TPU") if resources.get(k)) or "no resources"
        raise SpecError(f"elastic.use_gpu: true needs GPUs, but the Ray cluster has none ({has}); "
                        f"add GPU nodes or set elastic.use_gpu = false")


def _ray_connected() -> bool:
    """This process is connected to a Ray cluster already (the job runs there, not embedded)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _check_exists(field: str, path: str) -> None:
    try:
        fs, inner = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
        found = fs.get_file_info(inner).type != pafs.FileType.NotFound
    except (OSError, ValueError) as exc:
        raise SpecError(f"{field}: cannot open {path!r} ({exc})") from None
    if not found:
        raise SpecError(f"{field}: no such file or directory: {path!r}")


def _dataset_size(spec: JobSpec, source: str, field: str = "data.source") -> int:
    """A dataset's samples, once it opens and has rows and the columns the job reads (metadata only).
    The eval set's problems are named as its own (`field`), with the data field that asks for a column."""
    from elastic_zero.data.arrow_rows import ArrowRows, DataError

    try:
        return ArrowRows(source, spec.data.columns_read(own_collate=spec.data.collate is not None)).num_samples
    except DataError as exc:
        text = str(exc)
        if field != "data.source":
            text = f"{field}: " + text.removeprefix("data.source: ")
        raise SpecError(text) from None


def settle_steps(spec: JobSpec, size: int | None) -> JobSpec:
    """train.epochs as a step count, for a dataset of `size` samples (None: synthetic): every sample
    `epochs` times, in whole global batches (a last partial batch is dropped)."""
    if spec.train.epochs is None:
        return spec
    if size is None:
        raise ValueError("train.epochs: synthetic data is endless; give train.steps")
    steps = spec.train.epochs * size // spec.train.global_batch
    if steps < 1:
        raise ValueError(f"train.epochs: {spec.train.epochs} epoch(s) of {size} samples is less than one "
                         f"global batch of {spec.train.global_batch}")
    return spec.with_steps(steps)
