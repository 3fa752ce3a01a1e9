"""The goodput benchmark's pure parts: the seeded schedule of what happens to the cluster, and the
accounting of which steps counted.

The cluster starts with two worker nodes, `a` and `b`, of two workers' room each. In a window of
`window_s` seconds from the job's launch: node `a` vanishes without warning (frozen: it resets no
connection); some time later it is gone for good and a node `a2` comes in its place; node `b` is
told it will be preempted `notice_s` seconds ahead (a Ray drain with that deadline) and is killed at
the deadline; later a node `c` joins (the autoscaler's replacement, room for the job to scale up);
at the window's end the job is asked to stop.

Goodput is the time spent in steps that count (steps whose result the final model keeps: a step
completed and later recomputed counts once, in its last run) over the job's wall time, launch to exit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ACTIONS = ("node_lost", "node_back", "notice", "preempted", "scale_up", "end")
START_NODES = ("a", "b")


@dataclass(frozen=True)
class ClusterEvent:
    at_s: float  # seconds after the job's launch
    action: str  # one of ACTIONS
    node: str | None = None  # the node it concerns
    replaced_by: str | None = None  # node_back: the node that comes in its place
    deadline_s: float | None = None  # notice: how long before the node goes


def goodput_schedule(window_s: float, seed: int, notice_s: float = 30.0) -> tuple[ClusterEvent, ...]:
    """The same window and seed give the same schedule, for every system it is played to."""
    if notice_s <= 0:
        raise ValueError(f"notice_s must be > 0, got {notice_s}")
    if notice_s >= 0.09 * window_s:  # the node must be gone before the next event window opens
        raise ValueError(f"window_s {window_s:g} is too short for a {notice_s:g} s notice: "
                         f"need window_s > {notice_s / 0.09:.0f}")
    rng = random.Random(seed)
    lost = rng.uniform(0.15, 0.25) * window_s
    back = lost + rng.uniform(0.08, 0.12) * window_s
    notice = rng.uniform(0.45, 0.55) * window_s
    scale_up = rng.uniform(0.65, 0.75) * window_s
    return (ClusterEvent(round(lost, 1), "node_lost", "a"),
            ClusterEvent(round(back, 1), "node_back", "a", replaced_by="a2"),
            ClusterEvent(round(notice, 1), "notice", "b", deadline_s=notice_s),
            ClusterEvent(round(notice + notice_s, 1), "preempted", "b"),
            ClusterEvent(round(scale_up, 1), "scale_up", "c"),
            ClusterEvent(float(window_s), "end"))


def kept_steps(records: list[dict]) -> tuple[dict, int]:
    """Per-step records (`step`, `done`, ...) of every run of every step, in any order: the run of
    each step the final model keeps (its last), and how many completed runs were thrown away."""
    kept: dict = {}
    for record in sorted(records, key=lambda r: r["done"]):
        kept[record["step"]] = record
    return kept, len(records) - len(kept)


def goodput(kept_step_seconds, wall_s: float) -> float:
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    return sum(kept_step_seconds) / wall_s
