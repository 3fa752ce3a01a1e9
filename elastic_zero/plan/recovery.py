"""After a failure: the latest step every old rank's shard can be restored at, and who holds it.

Old rank r's snapshot of step s survives on r itself (if r survived) or as the replica held by
r's buddy (if the buddy survived). Pure.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from elastic_zero.plan.membership import Generation


def restore_point(
    old: Generation,
    survivors: Sequence[str],
    own_steps: Mapping[str, Sequence[int]],
    ward_steps: Mapping[str, Sequence[int]],
) -> tuple[int, tuple[str, ...]] | None:
    """(step, holder actor per old rank) for the latest step held for every old rank, else None.

    own_steps[a]: the steps of a's own snapshots; ward_steps[a]: the steps of the replicas a holds
    of its ward (the old rank whose buddy a is)."""
    alive = set(survivors)
    holders: list[dict[int, str]] = []  # per old rank: step -> holder
    for rank, member in enumerate(old.members):
        options: dict[int, str] = {}
        buddy = old.members[old.buddies[rank]].actor_id
        if buddy in alive and buddy != member.actor_id:
            for s in ward_steps.get(buddy, ()):
                options[s] = buddy
        if member.actor_id in alive:
            for s in own_steps.get(member.actor_id, ()):
                options[s] = member.actor_id  # prefer the rank's own copy
        holders.append(options)
    common = set.intersection(*(set(o) for o in holders)) if holders else set()
    if not common:
        return None
    step = max(common)
    return step, tuple(o[step] for o in holders)


def lost_ranks(old: Generation, survivors: Sequence[str]) -> tuple[int, ...]:
    alive = set(survivors)
    return tuple(r for r, m in enumerate(old.members) if m.actor_id not in alive)
