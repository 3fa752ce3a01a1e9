"""The elastic events of a `bench state-size` run, from what the run wrote (its summary and events) and
the RSS samples taken meanwhile: when each event happened, how much more memory a worker held during
it than just before, and how fast it moved its bytes. Pure: no Ray, no files.

An event's extra peak is the largest rise of a worker's RSS during it over that worker's steady
peak: its peak in the quiet steps before the first event (neither making nor finishing a replica
swap, the first step aside). A worker started later (a replacement) is held against the lowest
steady peak of the others. The world size an event leads to counts in its extra: a shard grows
when the world shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class EventWindow:
    name: str
    start: float  # epoch seconds
    end: float
    moved_bytes: int | None = None  # by the busiest worker
    moving_s: float | None = None  # the seconds it took to move them
    link: str | None = None  # "loopback" (TCP between workers) or "memory" (copies, files in the page cache)


def drills(kill_at: int, preempt_at: int) -> list[dict]:
    """A kill of rank 1 and a preemption notice for rank 0, at those steps. Each is followed by a
    scale-up: the replacement the job spawns joins when it is ready (a hand-over and a reshard), so
    the world never grows past its size: a node that holds the job at its size holds every event."""
    return [{"at_step": kill_at, "action": "kill", "rank": 1},
            {"at_step": preempt_at, "action": "preempt", "rank": 0, "deadline_s": 600.0}]


def swap_windows(summary: dict, replicate_every: int, before: float, shard_bytes: int) -> list[EventWindow]:
    """Replica swaps before `before` (epoch seconds): the step that ends with a commit (its update
    makes the snapshot, its exchange starts) and the next (the exchange finishes behind it). The bytes
    moved are a shard's replicated state; the seconds, the two steps' protect time: what training
    waited for the swap."""
    ends, times = dict(summary["step_end_curve"]), dict(summary["step_time_curve"])
    protect = dict(summary["protect_time_curve"])
    out = []
    for step in sorted(ends):
        if (step + 1) % replicate_every or step + 1 not in ends or ends[step + 1] >= before:
            continue
        out.append(EventWindow("replica swap", ends[step] - times[step], ends[step + 1], shard_bytes,
                               protect[step] + protect[step + 1], "loopback"))
    return out


def change_windows(summary: dict) -> list[EventWindow]:
    """A recovery from its failure to its next step done; a hand-over (a preemption's, a scale-up's or
    down's) from its safe point to its next step done. Bytes: what the busiest new rank took in from
    peers."""
    out = []
    for kind, changes in (("recovery", summary["recoveries"]), ("reconfiguration", summary["reconfigurations"])):
        for c in changes:
            sizes = f" ({c.get('from')} -> {c.get('to')})" if kind == "reconfiguration" else ""
            grew = (c.get("to") or 0) > (c.get("from") or 0)
            name = ("kill and recovery" if kind == "recovery" else "preemption hand-off" if c.get("cause") == "leave"
                    else "coordinator takeover" if c.get("cause") == "coordinator"
                    else "scale-up hand-over" if grew else "scale-down hand-over") + sizes
            phases = c.get("phases_s", {})
            moving = phases.get("handover", phases.get("read_checkpoint"))
            out.append(EventWindow(name, c["failed_at"], c["failed_at"] + (c.get("to_next_step_done_s") or 0.0),
                                   c.get("received_bytes"), moving,
                                   "loopback" if "handover" in phases else "memory"))
    return out


def save_windows(summary: dict, records: list[dict], saved: dict[str, tuple[int, int, int]]) -> list[EventWindow]:
    """A checkpoint save from the end of the step it saves to its commit: it is written beside the
    next step. `saved`: each committed directory's (steps done, bytes, world size that wrote it).
    Bytes: one worker's part of the directory."""
    ends = dict(summary["step_end_curve"])
    out = []
    for e in records:
        if e.get("event") != "checkpoint_committed" or e["directory"] not in saved:
            continue
        steps_done, nbytes, world = saved[e["directory"]]
        if steps_done - 1 not in ends:
            continue
        start = ends[steps_done - 1]
        out.append(EventWindow("checkpoint save", start, e["t"], nbytes // world, e["t"] - start, "memory"))
    return out


def quiet_steps(summary: dict, replicate_every: int, before: float) -> list[tuple[float, float]]:
    """(start, end) of each step done before `before` that neither makes a replica swap nor finishes
    one (the first step aside: it starts up); every step but the first when every step swaps."""
    ends, times = dict(summary["step_end_curve"]), dict(summary["step_time_curve"])
    done = [s for s in sorted(ends) if 0 < s and ends[s] < before]
    quiet = [s for s in done if replicate_every > 1 and (s + 1) % replicate_every and s % replicate_every]
    return [(ends[s] - times[s], ends[s]) for s in (quiet or done)]


def steady_peaks(samples: list[tuple[float, dict]], steps: list[tuple[float, float]]) -> dict[int, int]:
    """Each worker's peak RSS within `steps` (bytes, by pid)."""
    peaks: dict[int, int] = {}
    for t, procs in samples:
        if any(start <= t <= end for start, end in steps):
            for pid, (kind, rss) in procs.items():
                if kind == "worker":
                    peaks[pid] = max(peaks.get(pid, 0), rss)
    return peaks


def extra_peaks(samples: list[tuple[float, dict]], steady: dict[int, int],
                windows: list[EventWindow]) -> list[int | None]:
    """Each window's largest rise of a worker's RSS over its steady peak (bytes, never below 0); None
    for a window shorter than the sampling period that caught no sample (not measured, not 0)."""
    fallback = min(steady.values(), default=0)
    out = []
    for w in windows:
        rises = [rss - steady.get(pid, fallback) for t, procs in samples if w.start <= t <= w.end
                 for pid, (kind, rss) in procs.items() if kind == "worker"]
        out.append(max(0, max(rises)) if rises else None)
    return out


def start_up_extra(samples: list[tuple[float, dict]], first_step_done: float) -> int | None:
    """A resumed job: how far its workers' peak before the first step was done (reading the
    checkpoint, cutting it to this world size) rose over their peak while training after it (bytes);
    None where no worker was sampled on both sides (a job that ended within a sampling period)."""
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for t, procs in samples:
        for pid, (kind, rss) in procs.items():
            if kind == "worker":
                side = before if t <= first_step_done else after
                side[pid] = max(side.get(pid, 0), rss)
    rises = [before[p] - after[p] for p in before if p in after]
    return max(0, max(rises)) if rises else None


def rate_row(name: str, at_s: float | None, seconds: float | None, extra: int | None, shard_bytes: int,
             moved: int | None, moving_s: float | None, link: str | None, links: dict[str, float]) -> dict:
    """One row of the table: the extra peak against a shard, the bytes per second against the link's."""
    rate = moved / moving_s if moved and moving_s else None
    return {"event": name, "at_s": None if at_s is None else round(at_s, 1),
            "seconds": None if seconds is None else round(seconds, 2),
            "extra_peak_gib": None if extra is None else round(extra / GIB, 3),
            "of_a_shard": None if extra is None else round(extra / shard_bytes, 2),
            "moved_gib": None if moved is None else round(moved / GIB, 3),
            "moving_s": None if moving_s is None else round(moving_s, 3),
            "gb_per_s": None if rate is None else round(rate / 1e9, 3), "link": link,
            "of_link": round(rate / links[link], 2) if rate is not None and link in links else None}
