"""Buddy replication: every rank sends its shard snapshot to its buddy and keeps its ward's copy.

buddies[r] is the rank holding r's replica; the ward of rank b is the r with buddies[r] == b.
Snapshots live in host memory. A step's snapshots are kept until every rank is known to hold
the next step's (confirmed()), so that a failure in the middle of a replication still leaves an
older step that every survivor can restore: one step at rest, two while a swap is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from elastic_zero.zero.comm import Comm
from elastic_zero.zero.host_memory import host_empty
from elastic_zero.zero.host_pool import POOL
from elastic_zero.zero.shard import ShardState


@dataclass
class ReplicaStore:
    keep: int = 2
    own: dict[int, ShardState] = field(default_factory=dict)  # step -> this rank's snapshot
    ward: dict[int, ShardState] = field(default_factory=dict)  # step -> the ward's snapshot

    def add(self, step: int, own: ShardState, ward: ShardState | None) -> None:
        self.own[step] = own
        if ward is not None:
            self.ward[step] = ward
        for store in (self.own, self.ward):
            for old in sorted(store)[: -self.keep]:
                del store[old]

    def keep_latest(self, through: int | None = None) -> None:
        """Every rank holds the snapshots of step `through` (None: the latest): the older ones are
        needed no more. A later step is kept beside it: not every rank may hold that one yet."""
        for store in (self.own, self.ward):
            for old in sorted(store)[:-1] if through is None else [s for s in store if s < through]:
                del store[old]

    def keep_only(self, step: int) -> None:
        """A handover restores `step`: the other steps' snapshots are needed no more."""
        for store in (self.own, self.ward):
            for other in [s for s in store if s != step]:
                del store[other]

    def clear(self) -> None:
        self.own.clear()
        self.ward.clear()


@dataclass
class LayoutReplicas:
    """This rank's replicas by layout: those of the latest layout it committed in (`generation`)
    and, until every rank has committed that one too, those of the layout it was built from."""

    generation: int = -1
    current: ReplicaStore = field(default_factory=ReplicaStore)
    earlier: tuple[int, ReplicaStore] | None = None

    def of(self, generation: int) -> ReplicaStore | None:
        if self.generation == generation:
            return self.current
        if self.earlier is not None and self.earlier[0] == generation:
            return self.earlier[1]
        return None

    def add(self, generation: int, built_from: int | None, step: int, own: ShardState,
            ward: ShardState | None) -> None:
        """A commit of `step` in `generation`'s layout (built from `built_from`'s): the first one
        starts that layout's store and keeps the one it was built from as `earlier`."""
        if generation != self.generation:
            source = self.of(built_from) if built_from is not None else None
            self.earlier = (built_from, source) if source is not None else None
            self.current, self.generation = ReplicaStore(), generation
        self.current.add(step, own, ward)

    def confirmed(self, through: int | None = None) -> None:
        """Every rank has committed step `through` (None: the latest) of the current layout (a
        collective that all of them entered after their commit completed): the earlier layout and
        the older steps go, so that at rest a rank holds one snapshot of its own and one of its ward's."""
        if self.earlier is not None:
            self.earlier = None
            POOL.trim()  # its blocks are of sizes no longer asked for
        self.current.keep_latest(through)

    def clear(self) -> None:
        """Every layout's replicas go (the engine starts over, or a plan keeps none)."""
        self.generation, self.current, self.earlier = -1, ReplicaStore(), None

    def report(self) -> dict:
        """The steps held, as the coordinator's Outcome describes them."""
        earlier = ((self.earlier[0], tuple(sorted(self.earlier[1].own)), tuple(sorted(self.earlier[1].ward)))
                   if self.earlier is not None else ())
        return {"own_steps": tuple(sorted(self.current.own)), "ward_steps": tuple(sorted(self.current.ward)),
                "snapshot_generation": self.generation, "earlier": earlier}


def exchange(comm: Comm, snapshot: ShardState, buddies: Sequence[int],
             log: torch.Tensor | None = None) -> tuple[ShardState | None, torch.Tensor | None]:
    """Send `snapshot` (and `log`, an int64 [k, c] table with the same k on every rank) to this
    rank's buddy; return the ward's snapshot and log (None, None when alone). Everything sent is a
    host buffer (host_memory.py), and so is everything received: `comm` is the host group."""
    if comm.world_size == 1:
        return None, None
    me = comm.rank
    ward = buddies.index(me)
    names = sorted(snapshot.vectors)
    ward_numel = snapshot.partition.rank_numel(ward)
    # one message per vector, received into slices of one buffer: no packing copy on either side
    incoming = host_empty(ward_numel * len(names), snapshot.vectors[names[0]].dtype)
    handles = []
    for tag, name in enumerate(names):
        handles.append(comm.send(snapshot.vectors[name], buddies[me], tag=tag))
        handles.append(comm.recv(incoming[tag * ward_numel : (tag + 1) * ward_numel], ward, tag=tag))
    ward_log = None
    if log is not None and log.numel():
        ward_log = host_empty(log.numel(), log.dtype).reshape(log.shape)
        handles += [comm.send(log, buddies[me], tag=len(names)),
                    comm.recv(ward_log, ward, tag=len(names))]
    for h in handles:
        h.wait()
    return snapshot.unpacked(incoming, ward, snapshot.scalars), ward_log
