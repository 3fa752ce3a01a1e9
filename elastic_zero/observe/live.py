"""A running job's live figures and the `status --json` record (schema STATUS_SCHEMA, docs/service.md).

Rank 0 tells the coordinator its step and loss every half second; the rate is taken over the
notes of the last RATE_WINDOW_S seconds, recoveries and resizes included (it is what the job does).
"""

from __future__ import annotations

import threading
import urllib.parse
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0
STEP_TIMES_KEPT = 21  # the step times the median of the measured step is taken over (plan/stuck.py)
STATUS_SCHEMA = 7  # 2: "eval"; 3: "memory"; 4: "replicas"; 5: "workers"; 6: "standby"; 7: "as_of"
# every status record has exactly these keys (None where unknown), in this order
STATUS_KEYS = ("schema", "job_id", "name", "state", "ray_job_status", "generation", "world_size", "target_workers",
               "min_workers", "max_workers", "members", "step", "steps", "loss", "eval", "samples_per_s", "eta_s",
               "world_size_history", "recoveries", "reconfigurations", "restarts", "checkpoint", "run_dir",
               "coordinator", "error", "last_events", "memory", "replicas", "workers", "standby", "as_of")
QUIET_EVENTS = frozenset({"decision", "spawn", "worker_ready", "retire", "change_begun", "change_measured"})  # left out of last_events


@dataclass
class LiveProgress:
    global_batch: int
    steps: int
    step: int = 0
    loss: float | None = None
    step_seconds: float | None = None
    checkpoint: str | None = None  # the newest commit known: from rank 0's notes or a generation's reports
    eval: dict | None = None  # the latest evaluation rank 0 told of: step, loss, perplexity
    replicas: dict | None = None  # the replica cadence the latest generation agreed on (auto), and its cost
    _notes: deque = field(default_factory=deque)  # (time, step)
    _step_seconds: deque = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))  # the notes' latest
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, step: int, loss: float | None, step_seconds: float | None, at: float) -> None:
        """Notes may arrive out of order (the coordinator serves them on several threads): an older one is dropped."""
        with self._lock:
            if self._notes and at <= self._notes[-1][0]:
                return
            if self._notes and step < self._notes[-1][1]:  # a recovery went back to an earlier step
                self._notes.clear()
            # (None: a generation's first step, its loss read back during the next one: the last one known stays)
            self.step, self.loss, self.step_seconds = step, self.loss if loss is None else loss, step_seconds
            if step_seconds is not None:
                self._step_seconds.append(step_seconds)
            self._notes.append((at, step))
            while len(self._notes) > 2 and at - self._notes[0][0] > RATE_WINDOW_S:
                self._notes.popleft()

    def median_step_s(self) -> float | None:
        """The median of the latest steps' times the notes told (None: none yet)."""
        times = sorted(tuple(self._step_seconds))
        return times[len(times) // 2] if times else None

    def samples_per_s(self) -> float | None:
        notes = tuple(self._notes)
        if len(notes) < 2:
            return None
        (t0, s0), (t1, s1) = notes[0], notes[-1]
        return (s1 - s0) * self.global_batch / (t1 - t0) if t1 > t0 else None

    def eta_s(self) -> float | None:
        rate = self.samples_per_s()
        return (self.steps - self.step) * self.global_batch / rate if rate else None


def final_status_key(job_id: str) -> str:
    """Where a job's last status record stays in the cluster's key-value store once it is over."""
    return f"elastic_zero/final_status/{job_id}"


def status_file_name(job_id: str) -> str:
    """Where a live coordinator publishes its status record, relative to its node's Ray log directory
    (coordinator/status_file.py), for clients to read through the dashboard (service/published_status.py).
    The id is quoted: one given by `--job-id` may hold a slash."""
    return f"elastic_zero/{urllib.parse.quote(job_id, safe='')}.status.json"


def status_record(**values) -> dict:
    """The status record: STATUS_KEYS, each from `values` or None; unknown keys are a bug."""
    unknown = set(values) - set(STATUS_KEYS)
    if unknown:
        raise KeyError(f"not in the status schema: {sorted(unknown)}")
    record = {key: values.get(key) for key in STATUS_KEYS}
    record["schema"] = STATUS_SCHEMA
    return record


def last_events(records: list[dict], count: int = 10) -> list[dict]:
    return [r for r in records if r.get("event") not in QUIET_EVENTS and r.get("problem", True)][-count:]


def world_size_history(records: list[dict]) -> list[list]:
    """[step, world size] of each generation the job's events began, the step None while unknown: a
    generation that restores a checkpoint knows its step once it has read it (its
    `checkpoint_restored` event), as does a job that resumes one, or starts over from the one it
    resumed. A resuming generation that ended without a restore found nothing to resume: it began at
    its own step."""
    restored = {r["generation"]: r["step"] for r in records
                if r.get("event") == "checkpoint_restored" and r.get("step") is not None}
    ended = {r["generation"] for r in records if r.get("event") == "generation_end"}

    def step_of(start: dict) -> int | None:
        generation = start["generation"]
        if generation in restored:
            return restored[generation]
        unread = start["step"] < 0 or (start.get("resume") and generation not in ended)
        return None if unread else start["step"]

    return [[step_of(r), len(r["workers"])] for r in records if r.get("event") == "generation_start"]
