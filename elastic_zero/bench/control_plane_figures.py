"""The control plane's figures, read from a simulated run's events (events.jsonl) and from what the
simulated workers saw (plan arrivals, rendezvous times, hellos). Pure: no Ray, no clock."""

from __future__ import annotations

from typing import Sequence

MEMORY_PER_SIMULATED_WORKER = 8 << 20  # bytes: its threads and connections, here and in the coordinator's relay


def problems(workers: int, per_node: int, available_bytes: int | None, scale_up: int = 64,
             preempted: int = 8) -> list[str]:
    """One line per wrong argument of `bench control-plane`."""
    out = []
    if workers < 1:
        out.append(f"--workers: must be at least 1, got {workers}")
    if per_node < 1:
        out.append(f"--per-node: must be at least 1, got {per_node}")
    elif workers >= 1 and workers % per_node:
        out.append(f"--per-node: {per_node} does not divide --workers {workers}")
    elif workers >= 1 and (workers // per_node < 2 or (workers + scale_up) // per_node < preempted + 1):
        out.append(f"--workers: {workers} makes {workers // per_node} nodes of {per_node}: the scenario needs 2 (one "
                   f"falls silent), and {preempted + 1} once {scale_up} joined ({preempted} are preempted, one stays)")
    need = (workers + scale_up) * MEMORY_PER_SIMULATED_WORKER
    if available_bytes is not None and workers >= 1 and need > available_bytes:
        out.append(f"--workers: {workers} simulated workers (and 64 joiners) need about {need / 2**30:.1f} GiB, "
                   f"this machine has {available_bytes / 2**30:.1f} GiB available")
    return out


def busiest_nodes(events: Sequence[dict], members, count: int, skip: str) -> list[str]:
    """The `count` nodes holding the most of `members` (by their workers' hellos), `skip` left out."""
    node_of = {e["actor_id"]: e["node"] for e in events if e["event"] == "worker_ready"}
    held: dict[str, int] = {}
    for a in members:
        if node_of.get(a, skip) != skip:
            held[node_of[a]] = held.get(node_of[a], 0) + 1
    return sorted(held, key=lambda node: (-held[node], node))[:count]


def first(events: Sequence[dict], after: float, **match) -> dict | None:
    """The first event at or after `after` whose fields equal `match` (a callable value tests the field)."""
    for e in events:
        if e["t"] < after:
            continue
        if all(v(e.get(k)) if callable(v) else e.get(k) == v for k, v in match.items()):
            return e
    return None


def held_within(arrivals: dict[str, float], actor_ids, since: float) -> float | None:
    """Seconds from `since` until the last of `actor_ids` held its plan (None if one never did)."""
    times = [arrivals.get(a) for a in actor_ids]
    if not times or None in times:
        return None
    return round(max(times) - since, 4)


def rendezvous_s(times: dict[str, tuple[float, float]]) -> float | None:
    """From the first rank starting the group's rendezvous to the last one done."""
    if not times:
        return None
    return round(max(done for _, done in times.values()) - min(began for began, _ in times.values()), 4)


def merged(seen: Sequence[dict], key: str) -> dict:
    """The hosts' observations of `key` ({generation: {actor: value}} each) merged over every host."""
    out: dict = {}
    for s in seen:
        for generation, by_actor in s[key].items():
            out.setdefault(int(generation), {}).update(by_actor)
    return out


def growth(sizes: Sequence[int], values: Sequence[float | None]) -> float | None:
    """How a figure grows from the smallest size to the largest against linear growth: value ratio /
    size ratio (at most 1: linear or slower)."""
    pairs = [(n, v) for n, v in zip(sizes, values) if v]
    if len(pairs) < 2:
        return None
    (n0, v0), (n1, v1) = pairs[0], pairs[-1]
    return round((v1 / v0) / (n1 / n0), 3)
