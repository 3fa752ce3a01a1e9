"""Host buffers: where shard snapshots, replicas, handover shards and sample logs live.

Every host tensor that travels between workers is allocated here, so that it can be told apart
from a device tensor even on CPU, where both have device "cpu": the host group must carry only
these, the training group never (see TorchComm's role check). With a GPU the buffers are pinned,
so that a device-to-host copy can run asynchronously on a side stream; torch's caching host
allocator reuses pinned blocks, so a buffer per snapshot costs no new pinned allocation.

Knowing which storages are host buffers is done only while ELASTIC_ZERO_CHECK_TRAFFIC is set (the
tests set it for every job they run); the device check is always on. A storage is known until it is
freed: torch keeps one Python object per storage for as long as the storage lives, views included,
so a finalizer on that object says when the address stops being a host buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref

import torch

from elastic_zero.zero.host_pool import POOL

CHECK_TRAFFIC_ENV = "ELASTIC_ZERO_CHECK_TRAFFIC"

_known: set[int] = set()  # addresses of the live host buffers' storages
_lock = threading.Lock()


def _forget(address: int) -> None:
    with _lock:
        _known.discard(address)


def checking_traffic() -> bool:
    return bool(os.environ.get(CHECK_TRAFFIC_ENV))


def host_empty(numel: int, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """A new 1-D host buffer (pinned when `pinned` and CUDA is there; else, when large, over a
    block of host_pool's, reused once the buffer died)."""
    if pinned and torch.cuda.is_available():
        t = torch.empty(numel, dtype=dtype, pin_memory=True)
    else:
        t = POOL.empty(numel, dtype)
    if checking_traffic() and numel:  # an empty tensor has no storage address of its own
        storage = t.untyped_storage()
        with _lock:
            _known.add(storage.data_ptr())
        weakref.finalize(storage, _forget, storage.data_ptr()).atexit = False
    return t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host buffer holding a copy of `t` (flattened), wherever `t` lives."""
    out = host_empty(t.numel(), t.dtype)
    out.copy_(t.reshape(-1))
    return out


def is_host_buffer(t: torch.Tensor) -> bool:
    """Whether `t` is (a view of) a buffer from host_empty; meaningful only while checking traffic."""
    return t.device.type == "cpu" and t.numel() > 0 and t.untyped_storage().data_ptr() in _known


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
LARGE_ALLOCATION = 1 << 20
# glibc's own adaptive limits (its threshold rises to 32 MB at most, trimming at twice that)
STEP_MMAP_THRESHOLD, STEP_TRIM_THRESHOLD = 32 << 20, 64 << 20


def large_allocations_to_the_system() -> None:
    """Make glibc's malloc serve every allocation of LARGE_ALLOCATION bytes or more by its own
    mmap, given back to the system when freed (elsewhere: nothing). By default the threshold rises
    with each large block freed, up to 32 MB, and blocks below it stay in the heap, resident after
    they are freed: a worker that built a model, then its engine, would hold gigabytes it does not
    use, counted by Ray's memory monitor. For building and restoring; the steps then reuse their
    memory (step_allocations_in_the_heap)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)
        libc.mallopt(_M_TRIM_THRESHOLD, LARGE_ALLOCATION)


def step_allocations_in_the_heap() -> None:
    """Make glibc's malloc keep freed blocks below 32 MB in its heap for the next ones (elsewhere:
    nothing). For the steps: each step allocates and frees the same activations and gradients, and
    with large_allocations_to_the_system each came back as fresh pages, a fault and a zeroed page
    per 4 KiB: gpt-small on 2 ranks at ZeRO-2 took 70,000 faults and 0.44 s a step that way, 2,300
    and 0.34 s this way. The steps' working set stays resident between steps: GPT-2 medium's shape at
    ZeRO-3 on 2 workers peaked at 4.38 GiB a worker, 4.15 GiB before. Call it once the transients of
    building and restoring are gone (release_free_memory), so that the heap holds the steps' only."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD)


@contextlib.contextmanager
def building():
    """The workers' memory rules around a phase that builds or restores (an engine, a generation's
    entry) before steps: the large transients made inside go back to the system, and on leaving, the
    heap is trimmed and the steps' rule set. (Left by an exception, the building rule stays.)"""
    large_allocations_to_the_system()
    release_free_memory()  # what earlier steps left in the heap, before this phase's own peak
    yield
    release_free_memory()
    step_allocations_in_the_heap()


def release_free_memory() -> None:
    """Hand the free host blocks and the C heap's free pages back to the system now (glibc's
    malloc_trim; elsewhere the blocks only)."""
    POOL.trim()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def release_pinned_cache() -> None:
    """Hand the free pinned blocks that torch's caching host allocator keeps back to CUDA (a no-op
    before CUDA's first use). It waits for the device: worker/pinned_layouts.py says when it is due."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:  # (torch 2.3-2.8 name it _host_emptyCache; older ones have no way to)
        empty()


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt, _LIBC.malloc_trim  # glibc's, not another libc's
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


_LIBC = None
