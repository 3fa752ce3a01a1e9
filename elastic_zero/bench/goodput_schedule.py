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
import statistics
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
    _check_window(window_s, notice_s, 0.09)  # the node must be gone before the next event window opens
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


AUTOSCALED_ACTIONS = ("reclaim", "notice", "end")


def autoscaled_schedule(window_s: float, seed: int, notice_s: float = 30.0) -> tuple[ClusterEvent, ...]:
    """The schedule on a cluster whose nodes Ray's autoscaler starts and stops (`--autoscaler`): no
    node is added by hand. A node the job trains on is reclaimed without warning (its processes
    killed); later another is told it goes `notice_s` ahead (a Ray drain with that deadline) and is
    reclaimed at the deadline; the autoscaler brings a node back for each; at the window's end the
    job is asked to stop. The nodes are picked when played, oldest first ("first", "second"): their
    ids are the autoscaler's."""
    _check_window(window_s, notice_s, 0.2)  # the noticed node must be gone well before the window ends
    rng = random.Random(seed)
    reclaim = rng.uniform(0.15, 0.25) * window_s
    notice = rng.uniform(0.5, 0.6) * window_s
    return (ClusterEvent(round(reclaim, 1), "reclaim", "first"),
            ClusterEvent(round(notice, 1), "notice", "second", deadline_s=notice_s),
            ClusterEvent(round(notice + notice_s, 1), "reclaim", "second"),
            ClusterEvent(float(window_s), "end"))


def _check_window(window_s: float, notice_s: float, share: float) -> None:
    """A notice may take at most `share` of the window."""
    if not window_s > 0:  # NaN too
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if not notice_s >= 1:  # a Ray drain's deadline is whole seconds
        raise ValueError(f"notice_s must be >= 1, got {notice_s}")
    if notice_s >= share * window_s:
        raise ValueError(f"window_s {window_s:g} is too short for a {notice_s:g} s notice: "
                         f"need window_s > {notice_s / share:.0f}")


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


def elastic_zero_figures(summary: dict, events: list[dict], launched_at: float, wall_s: float) -> dict:
    """The figures of an elastic_zero run, from its summary.json and events.jsonl."""
    # a step's commit (replicas to its buddy) and checkpoint save protect it, as Ray Train's
    # checkpoints do; the time in steps that count is the training itself
    protect = dict(summary.get("protect_time_curve", []))
    steps = [seconds for _, seconds in summary.get("step_time_curve", [])]
    kept = [seconds - protect.get(step, 0.0) for step, seconds in summary.get("step_time_curve", [])]
    recoveries = summary.get("recoveries", [])
    # rank 0 tells the coordinator when its first step is done: from the launch, as for Ray Train
    stepped = [e["t"] for e in events if e["event"] == "decision" and e.get("on") == "GenerationStepped"]
    sizes = summary.get("world_size_history", [])
    ends = [(step, done, world_size_at(sizes, step), summary.get("global_batch", 0))
            for step, done in summary.get("step_end_curve", [])]
    return {"steps_kept": len(kept), "productive_s": round(sum(kept), 1), "goodput": round(goodput(kept, wall_s), 3),
            "step_s_median": _median(steps),  # the whole step, its commit and checkpoint included
            "steps_redone": sum(r.get("lost_steps") or 0 for r in recoveries),
            "samples_trained": summary.get("samples_consumed", 0) + summary.get("duplicate_samples", 0),
            "samples_kept": summary.get("samples_consumed", 0), "skipped_samples": summary.get("skipped_samples", 0),
            "useful_samples_per_s": round(summary.get("samples_consumed", 0) / wall_s, 2),
            "restarts": 0, "recoveries": len(recoveries), "reconfigurations": len(summary.get("reconfigurations", [])),
            "first_step_done_s": round(stepped[0] - launched_at, 1) if stepped else None,
            "world_sizes": sizes, "steady": steady_rates(ends)}


def ray_train_figures(records: list[dict], global_batch: int, launched_at: float, wall_s: float) -> dict:
    """The figures of a Ray Train run, from rank 0's per-step records of every attempt."""
    kept, redone = kept_steps(records)
    seconds = [r["done"] - r["started"] for r in kept.values()]
    first = min((r["done"] for r in records), default=None)
    return {"steps_kept": len(kept), "productive_s": round(sum(seconds), 1),
            "goodput": round(goodput(seconds, wall_s), 3), "step_s_median": _median(seconds), "steps_redone": redone,
            "samples_trained": len(records) * global_batch, "samples_kept": len(kept) * global_batch,
            "skipped_samples": 0, "useful_samples_per_s": round(len(kept) * global_batch / wall_s, 2),
            "restarts": len({r["attempt"] for r in records}) - 1, "recoveries": None, "reconfigurations": None,
            "first_step_done_s": None if first is None else round(first - launched_at, 1),
            "world_sizes": world_changes(records),
            "steady": steady_rates([(step, r["done"], r["world"], global_batch) for step, r in kept.items()])}


def torchft_figures(records: list[dict], global_batch: int, launched_at: float, wall_s: float,
                    restarts: int) -> dict:
    """The figures of a torchft run, from every replica group's step records. A step counts once, in
    the commit of the groups that took part in it; its time is the lowest such group's (rank 0's,
    as for Ray Train). It keeps those groups' shares of the global batch; the rest (the shares of
    groups lost or healing) torchft drops, and they count as skipped. An attempt that did not
    commit is redone under the same step number; a step committed in a timeline that was lost (every
    group gone, and the groups begun again at a lower step) is redone too, and only its last run kept.
    `restarts`: group processes started again after they failed (the job as a whole never restarts)."""
    kept: dict = {}
    thrown_away = 0  # committed steps lost when every group was gone and the groups began again below them
    highest = -1  # the highest step kept so far
    for r in sorted((r for r in records if r["committed"] and r["participating"]), key=lambda r: r["done"]):
        if r["step"] < highest - 1:  # a new timeline (the groups of a step commit it together)
            later = [step for step in kept if step >= r["step"]]
            thrown_away += len(later)
            for step in later:
                del kept[step]
            highest = r["step"]
        kept.setdefault(r["step"], []).append(r)
        highest = max(highest, r["step"])
    kept = {step: sorted(taken, key=lambda r: r["group"]) for step, taken in sorted(kept.items())}
    seconds = [taken[0]["done"] - taken[0]["started"] for taken in kept.values()]
    samples_kept = sum(r["samples"] for taken in kept.values() for r in taken)
    first = min((r["done"] for r in records if r["committed"]), default=None)
    sizes: list = []
    for step, taken in kept.items():
        if not sizes or sizes[-1][1] != len(taken):
            sizes.append([step, len(taken)])
    return {"steps_kept": len(kept), "productive_s": round(sum(seconds), 1),
            "goodput": round(goodput(seconds, wall_s), 3), "step_s_median": _median(seconds),
            "steps_redone": len({r["step"] for r in records if not r["committed"]}) + thrown_away,
            "samples_trained": sum(r["samples"] for r in records), "samples_kept": samples_kept,
            "skipped_samples": len(kept) * global_batch - samples_kept,
            "useful_samples_per_s": round(samples_kept / wall_s, 2),
            "restarts": restarts, "recoveries": None, "reconfigurations": None,
            "first_step_done_s": None if first is None else round(first - launched_at, 1), "world_sizes": sizes,
            "steady": steady_rates([(step, taken[0]["done"], len(taken), sum(r["samples"] for r in taken))
                                    for step, taken in kept.items()])}


def steady_rates(steps) -> dict:
    """Each world size's steady state, from the kept steps' (step, done, world size, samples kept):
    the median time from one step's end to the next's, both at that size, and the samples a step
    there keeps over that time. A gap across a change of size or a step not kept is the event's (a
    loss, a join), not the size's, and is left out, as are steps of no known size.
    {size: {"gaps", "step_s", "samples_per_s"}}, the largest size first."""
    gaps: dict = {}
    ordered = sorted(steps, key=lambda s: s[1])
    for (step, done, size, _), (next_step, next_done, next_size, samples) in zip(ordered, ordered[1:]):
        if size is not None and next_size == size and next_step == step + 1 and next_done > done:
            gaps.setdefault(size, []).append((next_done - done, samples))
    rates = {}
    for size, seen in sorted(gaps.items(), reverse=True):
        step_s = statistics.median(seconds for seconds, _ in seen)
        rates[size] = {"gaps": len(seen), "step_s": round(step_s, 4),
                       "samples_per_s": round(statistics.median(samples for _, samples in seen) / step_s, 2)}
    return rates


def world_size_at(history: list, step: int) -> int | None:
    """The world size that trained `step`, from a summary's [first step, size] history (None before its first)."""
    sizes = [size for first, size in history if first <= step]
    return sizes[-1] if sizes else None


def _median(seconds: list[float]) -> float | None:
    """The steady state's step time: the median of the kept steps (None without a step)."""
    return round(statistics.median(seconds), 4) if seconds else None


def world_changes(records: list[dict]) -> list:
    """[first step of each attempt, its world size], in time order."""
    changes, attempt = [], None
    for r in sorted(records, key=lambda r: r["done"]):
        if r["attempt"] != attempt:
            changes.append([r["step"], r["world"]])
            attempt = r["attempt"]
    return changes
