"""Execute a reshard plan between processes: each transfer goes from the process that holds the
source range (the old rank itself, or its buddy's replica) to the new rank that needs it.

Each transfer of each state vector is one message, sent from a slice of the held shard and
received straight into its slice of the new one: no packing or unpacking copies. Every send and
receive is posted before any is waited on, so no ordering can deadlock.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from elastic_zero.plan.partition import Partition
from elastic_zero.plan.reshard import plan_reshard
from elastic_zero.zero.comm import Comm
from elastic_zero.zero.host_memory import host_empty
from elastic_zero.zero.shard import ShardState


def hand_over(
    comm: Comm,
    old: Partition,
    new: Partition,
    holder_of_old: Sequence[int],
    member_of_new: Sequence[int],
    held: Mapping[int, ShardState],
    template: ShardState,
) -> ShardState | None:
    """Move the shards of partition `old` to partition `new` across the processes of `comm`.

    holder_of_old[r]: the comm rank holding old rank r's shard; member_of_new[r]: the comm rank that
    becomes new rank r; held: the old shards this process holds, by old rank; template: any shard
    of `old` (for layout, vector names and scalars). `comm` is a host group: the shards held and the
    one returned are host buffers (host_memory.py). Returns this process's new shard, or None when
    it has no new rank (it is leaving)."""
    if len(holder_of_old) != old.world_size or len(member_of_new) != new.world_size:
        raise ValueError("hand_over: holders must name every old rank and members every new rank")
    me = comm.rank
    missing = [r for r, h in enumerate(holder_of_old) if h == me and r not in held]
    if missing:
        raise ValueError(f"hand_over: process {me} is named holder of old ranks {missing} but does not hold them")
    names = sorted(template.vectors)
    plan = plan_reshard(old, new)
    my_new = member_of_new.index(me) if me in member_of_new else None
    out = None
    if my_new is not None:
        numel = new.rank_numel(my_new)
        vectors = {n: host_empty(numel, template.vectors[n].dtype) for n in names}
        out = ShardState(template.layout, new, my_new, vectors, dict(template.scalars))

    handles = []
    for i, t in enumerate(plan):
        src, dst = holder_of_old[t.src], member_of_new[t.dst]
        if me not in (src, dst):
            continue
        for v, n in enumerate(names):
            tag = i * len(names) + v  # the same on both sides: both walk the same plan
            source = held[t.src].vectors[n][t.src_offset : t.src_offset + t.numel] if src == me else None
            target = out.vectors[n][t.dst_offset : t.dst_offset + t.numel] if dst == me else None
            if src == dst:
                target.copy_(source)
            elif src == me:
                handles.append(comm.send(source, dst, tag=tag))
            else:
                handles.append(comm.recv(target, src, tag=tag))
    for handle in handles:
        handle.wait()
    return out
