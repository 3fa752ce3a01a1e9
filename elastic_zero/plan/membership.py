"""Membership: rank assignment per generation and replica ("buddy") placement. Pure.

Survivors keep their relative order (so shards move as little as possible), newcomers follow in
actor_id order. Each rank's shard is copied to exactly one buddy, chosen as a fixed shift around a
ring ordered by failure domain, so that every rank holds one replica and the copy lands on another
node whenever no node holds more than half the ranks, and in another zone when no zone does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Member:
    actor_id: str  # stable for the worker's life
    node: str
    zone: str = ""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[Member, ...]  # index = rank in this generation
    buddies: tuple[int, ...]  # buddies[r]: the rank that holds r's replica (r itself when alone)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, actor_id: str) -> int:
        for rank, m in enumerate(self.members):
            if m.actor_id == actor_id:
                return rank
        raise KeyError(f"actor {actor_id!r} is not a member of generation {self.number}")


def place_buddies(members: Sequence[Member]) -> tuple[int, ...]:
    """A buddy for every rank: a derangement (for 2+ ranks) that best separates failure domains."""
    n = len(members)
    if n <= 1:
        return tuple(range(n))
    ring = sorted(range(n), key=lambda r: (members[r].zone, members[r].node, r))

    def score(shift: int) -> tuple[int, int]:
        # another machine first (the common failure), then another zone
        pairs = [(members[ring[i]], members[ring[(i + shift) % n]]) for i in range(n)]
        other_node = sum((a.zone, a.node) != (b.zone, b.node) for a, b in pairs)
        return (other_node, sum(a.zone != b.zone for a, b in pairs))

    # the first shift that reaches the bound for both domains is the best one (ties go to the smallest
    # shift); a scan of every shift is O(n^2): a second at 1,024 ranks
    bound = (_separable_pairs(n, [(m.zone, m.node) for m in members]), _separable_pairs(n, [m.zone for m in members]))
    best, best_score = 1, None
    for shift in range(1, n):
        current = score(shift)
        if best_score is None or current > best_score:
            best, best_score = shift, current
        if current == bound:
            break
    buddies = [0] * n
    for i in range(n):
        buddies[ring[i]] = ring[(i + best) % n]
    return tuple(buddies)


def _separable_pairs(n: int, domains: list) -> int:
    """The most of n (rank, buddy) pairs that can lie in different domains: none is better than every
    rank paired out of its domain, and the largest domain's ranks can only pair out of it with the others."""
    largest = max(Counter(domains).values())
    return min(n, 2 * (n - largest))


def next_generation(previous: Generation | None, members: Sequence[Member]) -> Generation:
    """The generation after `previous` with exactly `members` (survivors and newcomers)."""
    ids = [m.actor_id for m in members]
    if len(set(ids)) != len(ids):
        raise ValueError(f"actor ids must be unique, got {sorted(ids)}")
    if not members:
        raise ValueError("a generation needs at least one member")
    old_order = {m.actor_id: r for r, m in enumerate(previous.members)} if previous else {}
    survivors = sorted((m for m in members if m.actor_id in old_order), key=lambda m: old_order[m.actor_id])
    newcomers = sorted((m for m in members if m.actor_id not in old_order), key=lambda m: m.actor_id)
    ordered = tuple(survivors + newcomers)
    number = previous.number + 1 if previous else 0
    return Generation(number=number, members=ordered, buddies=place_buddies(ordered))
