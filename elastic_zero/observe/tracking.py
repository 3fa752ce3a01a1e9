"""Experiment tracking ([tracking]): the coordinator hands what the job does to MLflow and TensorBoard.

What goes there: the spec as parameters (once, when the tracked run is created); rank 0's loss at
every step (its progress notes carry the steps since the last note); each evaluation; the world size,
recoveries, reconfigurations and their stalls; at the end the summary and the plot as artifacts.
`points_of_event` turns the job's events into metric points (pure); the backends live in
tracking_mlflow.py and tracking_tensorboard.py.

A tracker must never hold training up: calls go through a queue to one thread, and a backend that
fails (unreachable, not writable) is dropped with one warning, which reaches summary.warnings.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import threading
from typing import Callable

BACKENDS = {"mlflow": ("mlflow", "mlflow"), "tensorboard": ("tensorboard", "tensorboard")}  # module, extra
FINISH_TIMEOUT_S = 30.0  # the most a job's end waits for its trackers, once to flush and once to finish
FAILURES_TO_DROP = 3  # calls failed in a row before a tracker is dropped (one blip must not end it)


def missing_extra(backend: str) -> str | None:
    """The one-line error for a backend whose library is not installed (None if it is)."""
    module, extra = BACKENDS[backend]
    if importlib.util.find_spec(module) is None:
        return (f"tracking.backends: {backend!r} needs {module}, which is not installed: "
                f"pip install 'elastic-zero[{extra}]'")
    return None


def points_of_event(record: dict) -> list[tuple[str, float, int]]:
    """(metric, value, step) of an event of the job (events.jsonl)."""
    kind = record.get("event")
    if kind == "eval":
        step = record["step"]
        points = [("eval/loss", record["loss"], step)]
        if record.get("perplexity") is not None:
            points.append(("eval/perplexity", record["perplexity"], step))
        points += [(f"eval/{name}", value, step) for name, value in (record.get("metrics") or {}).items()]
        return points
    if kind == "generation_start" and record.get("step", -1) >= 0:  # a checkpoint restore's is known later
        return [("job/world_size", len(record.get("workers", ())), record["step"])]
    return []


def points_of_change(change: dict, kind: str, count: int) -> list[tuple[str, float, int]]:
    """A recovery or reconfiguration the books measured (`count`: how many of its kind so far)."""
    if change.get("step") is None:
        return []
    points = [(f"job/{kind}", count, change["step"])]
    if change.get("stall_s") is not None:
        points.append(("job/stall_s", change["stall_s"], change["step"]))
    return points


def spec_params(spec: dict) -> dict[str, str]:
    """The spec as flat parameters: `section.field` -> its value as text (faults: one JSON list)."""
    params = {}
    for section, values in spec.items():
        if isinstance(values, dict):
            for key, value in values.items():
                if value is not None and value != [] and value != {}:
                    params[f"{section}.{key}"] = value if isinstance(value, str) else json.dumps(value, default=repr)
        elif values not in (None, [], ()):
            params[section] = values if isinstance(values, str) else json.dumps(values, default=repr)
    return {k: v[:500] for k, v in params.items()}


class Tracking:
    """The job's trackers behind one thread. `backends`: objects with a name, start(), metrics(points),
    finish(summary_path, plot_path, ok) and abandon() (tracking_mlflow.py, tracking_tensorboard.py);
    `warn(text)`: how a failing one is told (the coordinator's warning path)."""

    def __init__(self, backends: list, warn: Callable[[str], None]) -> None:
        self._backends = list(backends)
        self._warn = warn
        self._changes: dict = {}  # recoveries and reconfigurations so far
        self._failures: dict = {}  # a backend's calls failed in a row
        self._lock = threading.Lock()  # notes come on the coordinator's threads, generation ends on its loop
        self._told_through = -1  # the latest step whose loss went to the trackers
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tracking")
        self._thread.start()
        self._call("start")

    def event(self, record: dict) -> None:
        try:
            points = points_of_event(record)
        except Exception as exc:  # noqa: BLE001 - called inside the coordinator's logging: never raises
            self._warn(f"tracking: an event could not be read: {type(exc).__name__}: {exc}"[:300])
            return
        if points:
            self._call("metrics", points)

    def train_points(self, points: list[tuple[int, float]], samples_per_s: float | None) -> None:
        """Rank 0's (step, loss) since its last note, and the throughput then."""
        with self._lock:
            self._told_through = max([self._told_through, *(step for step, _ in points)])
        out = [("train/loss", loss, step) for step, loss in points]
        if points and samples_per_s is not None:
            out.append(("train/samples_per_s", samples_per_s, points[-1][0]))
        if out:
            self._call("metrics", out)

    def generation_losses(self, losses: dict) -> None:
        """A generation's every (step: loss), from its reports: the steps no note told (a generation
        that failed between two notes) reach the trackers too."""
        with self._lock:
            untold = sorted((step, loss) for step, loss in losses.items() if step > self._told_through)
        self.train_points(untold, None)

    def change(self, change: dict, kind: str) -> None:
        """A recovery or reconfiguration (`kind`) the books measured: counted, and its stall."""
        with self._lock:
            self._changes[kind] = self._changes.get(kind, 0) + 1
            count = self._changes[kind]
        points = points_of_change(change, kind, count)
        if points:
            self._call("metrics", points)

    def flush(self, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Wait until what was queued so far has been handed to the trackers (or failed, and its
        warning told): whether it was, within the timeout."""
        done = threading.Event()
        self._queue.put(("_mark", (done,)))
        return done.wait(timeout_s)

    def finish(self, summary_path: str, plot_path: str | None, ok: bool) -> None:
        """The artifacts and the run's end; waits at most FINISH_TIMEOUT_S for the trackers."""
        self._call("finish", summary_path, plot_path, ok)
        self._queue.put(None)
        self._thread.join(FINISH_TIMEOUT_S)
        if self._thread.is_alive():
            self._warn(f"tracking: the trackers did not finish within {FINISH_TIMEOUT_S:g} s; what they had not "
                       f"written is lost")

    def _call(self, method: str, *args) -> None:
        self._queue.put((method, args))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            method, args = item
            if method == "_mark":
                args[0].set()
                continue
            for backend in list(self._backends):
                try:
                    getattr(backend, method)(*args)
                    self._failures[backend.name] = 0
                except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                    failures = self._failures[backend.name] = self._failures.get(backend.name, 0) + 1
                    if method not in ("start", "finish") and failures < FAILURES_TO_DROP:
                        continue  # a blip: what that call carried is lost, the next ones are tried
                    self._drop(backend, exc)

    def _drop(self, backend, exc: Exception) -> None:
        """Off for the rest of the job, told once; the backend marks its run failed if it still can."""
        self._backends.remove(backend)
        text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        self._warn(f"tracking: {backend.name} failed and is off for the rest of the job: {type(exc).__name__}: {text}")
        try:
            backend.abandon()
        except Exception:  # noqa: BLE001 - it failed already; this was a courtesy
            pass


def start_tracking(spec, spec_dict: dict, job_id: str, run_dir: str, warn: Callable[[str], None],
                   restarted: bool) -> Tracking | None:
    """The job's trackers, as its [tracking] section asks (None: it asks for none). A backend whose
    library is missing here is a warning: the job trains untracked rather than not at all.
    `restarted`: the coordinator was restarted, and its predecessor's MLflow run goes on."""
    import os

    t = spec.tracking
    if not t.backends:
        return None
    params, backends = spec_params(spec_dict), []
    for backend in t.backends:
        if (problem := missing_extra(backend)) is not None:
            warn(f"tracking: {problem}")
            continue
        if backend == "mlflow":
            from elastic_zero.observe.tracking_mlflow import MlflowTracker

            # no URI: the driver gave ./mlruns where it runs on an embedded Ray; on a cluster, the run directory's
            backends.append(MlflowTracker(t.mlflow_uri or os.path.join(run_dir, "mlruns"), t.experiment or spec.name,
                                          job_id, run_dir, params, spec.checkpoint.uri,
                                          resume=spec.checkpoint.resume is not None, restarted=restarted))
        else:
            from elastic_zero.observe.tracking_tensorboard import TensorBoardTracker

            backends.append(TensorBoardTracker(t.tensorboard_dir or os.path.join(run_dir, "tensorboard"), params))
    return Tracking(backends, warn) if backends else None
