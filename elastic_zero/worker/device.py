"""The device a worker trains on: its CPU, or the one GPU Ray assigned it."""

from __future__ import annotations

import os

import torch


def worker_device(use_gpu: bool) -> torch.device:
    """Ray narrows CUDA_VISIBLE_DEVICES to an actor's GPUs (num_gpus=1), so its GPU is cuda:0; where
    that is turned off (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) the id Ray assigned is the index.
    Raises ValueError, naming elastic.use_gpu, when no GPU is visible to this process."""
    if not use_gpu:
        return torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        raise ValueError(f"elastic.use_gpu: this worker sees no CUDA device (CUDA_VISIBLE_DEVICES={visible!r}, "
                         f"torch {torch.__version__}, CUDA build {torch.version.cuda})")
    index = cuda_index(_ray_gpu_ids(), visible)
    if index >= torch.cuda.device_count():
        raise ValueError(f"elastic.use_gpu: the GPU Ray assigned is CUDA device {index}, but this worker sees "
                         f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={visible!r})")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)  # on this thread; train() sets it again on the thread it runs on
    # CUDA's context now, so that the worker's start counts it as the device's and not the model's
    # (worker/start_clock.py): set_device alone need not make it
    torch.empty(1, device=device)
    return device


def cuda_index(ray_gpu_ids: list, visible: str | None) -> int:
    """The CUDA index of the GPU Ray assigned: 0 when CUDA_VISIBLE_DEVICES lists just the assigned
    ones (Ray narrowed it), else the assigned id's place among the visible ones (or the id itself)."""
    if not ray_gpu_ids:
        return 0
    assigned = str(ray_gpu_ids[0])
    shown = [d.strip() for d in visible.split(",")] if visible else []
    if shown and assigned in shown:
        return shown.index(assigned)
    return int(assigned) if assigned.isdigit() else 0


def _ray_gpu_ids() -> list:
    try:
        import ray

        return ray.get_gpu_ids() if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - outside a Ray worker: the first visible device
        return []
