"""Reused host blocks: the memory behind large unpinned host buffers, taken again after they die.

A worker that replicates every step makes a new snapshot of its shard and receives its ward's into
a new buffer each step, and drops the ones from two steps before: the same sizes, over and over.
Fresh memory costs a page fault and a zeroed page per 4 KiB, and glibc maps fresh memory for every
block above its mmap threshold (32 MB while a worker steps, 1 MB while it builds: host_memory.py),
which a real model's shard is far above. Measured here, a snapshot of 32 MB and a receive buffer of
32 MB a step cost 24 ms of CPU in fresh memory and 2 ms in reused memory, against a 0.55 s step of
gpt-small on two cores.

So a large buffer's memory is an anonymous mapping of this pool's, lent to a tensor made over it
(torch.frombuffer). When that tensor's storage dies (its last view included: torch keeps one Python
object per storage for as long as the storage lives) the block comes back, and the next request
of the same size takes it. Memory is reused only once nothing can read it. The pool keeps a few
free blocks of a size (FREE_PER_SIZE), of the sizes asked for lately (ASKED_HORIZON): blocks of a
size no longer asked for (the shard's size changed with the layout) are not held, and a worker
giving its free memory back (trim()) gives them all.

Pinned buffers (CUDA) are not made here: torch's caching host allocator already reuses those.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import torch

MIN_POOLED_BYTES = 1 << 20  # smaller allocations come from malloc's heap, which keeps them anyway
FREE_PER_SIZE = 4  # a step's snapshot of 3 vectors (AdamW) and receive buffer of another size
ASKED_HORIZON = 32  # requests: a step asks for one block a vector and one more, each the same size as before


class FreeBlocks:
    """The pool's books, apart from memory: free blocks by size, at most `per_size` of each, and
    none of a size not asked for in the last `horizon` requests (a layout's sizes, once it changed)."""

    def __init__(self, per_size: int = FREE_PER_SIZE, horizon: int = ASKED_HORIZON) -> None:
        self.per_size, self.horizon = per_size, horizon
        self._free: dict[int, list] = {}
        self._asked: dict[int, int] = {}  # size -> the number of the last request for it
        self._requests = 0

    def take(self, nbytes: int):
        """A free block of `nbytes`, or None."""
        self._requests += 1
        self._asked[nbytes] = self._requests
        for stale in [n for n, last in self._asked.items() if last <= self._requests - self.horizon]:
            del self._asked[stale]
            self._free.pop(stale, None)
        blocks = self._free.get(nbytes)
        return blocks.pop() if blocks else None

    def give(self, nbytes: int, block) -> bool:
        """Keep `block` for a later take; False when `nbytes` has enough free blocks already or was
        not asked for lately."""
        blocks = self._free.setdefault(nbytes, []) if nbytes in self._asked else None
        if blocks is None or len(blocks) >= self.per_size:
            return False
        blocks.append(block)
        return True

    def clear(self) -> None:
        self._free.clear()

    def free_bytes(self) -> int:
        return sum(nbytes * len(blocks) for nbytes, blocks in self._free.items())


class HostBlockPool:
    def __init__(self, per_size: int = FREE_PER_SIZE) -> None:
        self._books = FreeBlocks(per_size)
        self._lock = threading.Lock()
        # A storage may die on any thread (a collective's, a writer's), and within the locked region
        # too (a garbage collection there), so a dying one only appends its block here, which needs no
        # lock (deque.append is atomic); the next call that takes the lock enters it in the books.
        self._returned: collections.deque = collections.deque()
        self.fresh = 0  # blocks mapped anew, for tests and benchmarks
        self.reused = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D tensor of `numel` elements of `dtype`, over a reused block when there is one."""
        nbytes = numel * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            self._enter_returned()
            block = self._books.take(nbytes)
            if block is None:
                self.fresh += 1
            else:
                self.reused += 1
        if block is None:
            block = mmap.mmap(-1, nbytes, flags=_PRIVATE)
        t = torch.frombuffer(block, dtype=dtype, count=numel)
        # the storage holds the block while it lives; then the finalizer hands it back (never at the
        # interpreter's exit, when finalizers run early and a daemon thread may still use the tensor)
        weakref.finalize(t.untyped_storage(), self._returned.append, (nbytes, block)).atexit = False
        return t

    def _enter_returned(self) -> None:
        """(Under the lock.) The blocks whose storages died since, into the books; a block not kept
        there is unmapped when its last reference goes."""
        while self._returned:
            nbytes, block = self._returned.popleft()
            self._books.give(nbytes, block)

    def trim(self) -> None:
        """Forget every free block (their memory goes back to the system)."""
        with self._lock:
            self._enter_returned()
            self._books.clear()

    def free_bytes(self) -> int:
        with self._lock:
            self._enter_returned()
            return self._books.free_bytes()


# private: a shared anonymous mapping would be shmem, counted apart and kept across a fork
_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
POOL = HostBlockPool()
