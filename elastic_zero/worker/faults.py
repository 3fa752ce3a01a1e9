"""Telling a worker's faults from its bugs, and its start failures, in one line each."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_zero.zero.abortable import GroupAborted
from elastic_zero.zero.comm import TrafficError
from elastic_zero.zero.unit_flow import StepInterrupted


class WorkerStartError(RuntimeError):
    """The worker could not build its model or open its data: one line naming the field."""


def named(field: str, build):
    """Call `build`; an error that does not name a spec field already gets `field` in front."""
    try:
        return build()
    except Exception as exc:  # re-raised with the field named, never swallowed
        text = str(exc).splitlines()[0] if str(exc) else ""
        if text.split(":", 1)[0].split(".")[0] in ("model", "data", "eval", "train"):
            raise
        raise ValueError(f"{field}: {type(exc).__name__}: {text}") from exc


def is_communication_failure(exc: Exception, aborted: bool) -> bool:
    """A fault of the group (a lost peer, a timeout, an abort) rather than a bug of this worker.
    gloo reports a lost peer or a timeout as a plain RuntimeError from its sources."""
    if isinstance(exc, TrafficError):  # a tensor on the wrong group: a bug, whatever its text says
        return False
    if aborted or isinstance(exc, (GroupAborted, StepInterrupted, dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("gloo", "NCCL", "onnection", "imed out"))


def is_device_failure(exc: BaseException) -> bool:
    """The worker's GPU failed: a CUDA error leaves its context unusable, so the worker ends its
    process and is recovered like a kill. Running out of memory and a device-side assert are the
    job's to fix (they would recur on every replacement), so they stay errors that end the job."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    text = str(exc)
    if "device-side assert" in text:
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "cudaError" in text)


def ray_node_id() -> tuple[str | None, str]:
    """(this worker's Ray node id, or None with the reason)."""
    try:
        import ray

        if not ray.is_initialized():
            return None, "Ray is not initialised in this process"
        return ray.get_runtime_context().get_node_id(), ""
    except Exception as exc:  # reported by hello() as the member's warning
        return None, f"{type(exc).__name__}: {exc}"
