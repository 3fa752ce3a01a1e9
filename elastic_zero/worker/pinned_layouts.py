"""When a worker hands the pinned host blocks torch keeps cached back to CUDA.

On a GPU a rank's own snapshots (its replicas, a save's copy, a hand-over's) come off the device
into pinned buffers, and torch's caching host allocator keeps each freed block for a later request
of its size, a power of two, for the life of the process. Once the rank's shard changes size (a
world change, a rank that moved), no later snapshot asks for the old blocks: without a release
they stay pinned and unused beside the new ones, where the memory plan (plan/memory.py) counts one
layout's. A release (zero/host_memory.release_pinned_cache) frees only blocks no tensor holds, and
cudaFreeHost waits for the device; so it is due once per change of block size, and runs at a
commit every rank confirmed, when nothing of the old layout is held any more: the entry and its
hand-over are over, the replicas of the layout before were dropped, and no save is being written
(one may hold a copy of the old layout). A plan that drops the replicas (no room for them) makes
one due too. Pure: the trainer tells it what happened.
"""

from __future__ import annotations

from typing import Callable

from elastic_zero.plan.memory import pinned_block_bytes


class PinnedLayouts:
    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._block: int | None = None  # the block of a snapshot's vector in the layout entered last
        self._due = False

    def entered(self, shard_numel: int, element_bytes: int = 4) -> None:
        """A generation entered, this rank's shard `shard_numel` elements (each snapshot vector, fp32)."""
        block = pinned_block_bytes(shard_numel * element_bytes)
        if self._block is not None and block != self._block:
            self._due = True  # the old layout's blocks: no request of this layout takes them
        self._block = block

    def dropped(self) -> None:
        """The replicas were dropped (a plan without room for them): their blocks are free."""
        self._due = True

    @property
    def release_due(self) -> bool:
        """An old layout's blocks wait to be given back (settle() holds them while it is in use)."""
        return self._due

    def settle(self, old_layout_held: bool) -> bool:
        """At a commit every rank confirmed: release when one is due and nothing of an old layout
        is held (`old_layout_held`: replicas of the layout before, a save being written). True if it did."""
        if not self._due or old_layout_held:
            return False
        self._due = False
        self._release()
        return True
