"""The coordinator actor: one per job, the only owner of membership. It hosts the job's rendezvous
store, spawns its workers and starts its generations, through its loop (job_loop.py), which runs on a
thread of its own from the start: the job goes on whoever waits for it (or nobody: on a cluster it
is a detached actor, and its driver may die). Workers never wait on it on the training path: they
report when a generation ends, and rank 0 sends fire-and-forget notes of its progress.

This class is what Ray calls: requests (scale, stop), notes from the workers and the node watchers,
and views (status, progress, result; face.py builds them). Each is handed to the part that owns it,
or put into the loop's inbox where the loop must decide.

Its driver starts it again if its process dies (driver.py says why not Ray); the new one resumes
from the latest checkpoint (its workers died with it).

It imports no torch: its rendezvous store is served by its relay's process in Python, with torch's
protocol (wire/rendezvous.py, wire/store_server.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time

import ray

from elastic_zero.coordinator.events import (GenerationStepped, NodeNotice, PreemptionNotice, ScaleRequested,
                                             StopRequested)
from elastic_zero.coordinator.face import final_status, progress_of, publish_final_status, state_name, status_of
from elastic_zero.coordinator.job_loop import JobLoop
from elastic_zero.coordinator.status_file import StatusFile, ray_log_dir
from elastic_zero.job.sections import scale_refusal
from elastic_zero.preemption.notices import Notice

NAMESPACE = "elastic_zero"
LINGER_S = 120.0  # a finished coordinator nobody collected from goes after this long (ELASTIC_ZERO_LINGER_S)


def coordinator_name(job: str) -> str:
    return f"elastic-zero:{job}"


class Coordinator:
    def __init__(self, spec: dict, job_id: str, run_dir: str, started_at: float, restarted: bool = False,
                 workforce=None) -> None:
        """`restarted`: a driver started it again after the job's coordinator died (never Ray:
        max_restarts=0, driver.py). `workforce`: where its workers come from (workforce.py; None: a
        Ray actor each)."""
        self.job = JobLoop(spec, job_id, run_dir, started_at, restarted, workforce, coordinator_name(job_id),
                           NAMESPACE)
        self._done = threading.Event()
        self._collected = threading.Event()  # the driver took the result
        log_dir = ray_log_dir()
        self._status_file = None if log_dir is None else StatusFile(
            log_dir, job_id, self.status, lambda message: self.job.log("warning", message=message))
        if self._status_file is not None:  # before the loop, whose end stops it
            self._status_file.start()
        threading.Thread(target=self._main, daemon=True, name="coordinator-loop").start()

    def _main(self) -> None:
        job = self.job
        try:
            job.run(final_status(job.job_id) if job.restarted else None)
        finally:
            final = None
            try:
                job.record.write_summary(job.result, job_id=job.job_id, coordinator_restarts=job.restarts,
                                         memory=job.memory.summary(job.state.memory, job.generations.last_plan),
                                         replicas=job.record.replicas(None, current=False))
                final = self.status()
                publish_final_status(job.job_id, final)
            finally:
                try:
                    if self._status_file is not None:
                        self._status_file.stop(final)
                finally:
                    self._done.set()
        # nobody may be left to collect the result (a cluster): go after a while, by its own handle (no restart)
        if not self._collected.wait(float(os.environ.get("ELASTIC_ZERO_LINGER_S", LINGER_S))):
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- requests --------------------------------------------------------------------------------

    def scale(self, workers: int) -> str:
        job, e = self.job, self.job.spec.elastic
        refusal = scale_refusal(int(workers), e.min_workers, e.max_workers)
        if refusal:
            raise ValueError(refusal)
        if job.result is not None:
            raise ValueError(f"job {job.job_id} is over: {state_name(job)}")
        if job.state.stop_requested:
            raise ValueError(f"job {job.job_id} is stopping")
        job.log("scale_requested", workers=int(workers))
        job.inbox.put(ScaleRequested(int(workers)))
        return f"scale to {workers} requested"

    def stop(self, checkpoint: bool = False) -> str:
        """Every stop writes a checkpoint at its safe point (the weights the job ends with); `checkpoint`
        is kept for the callers that ask for it by name."""
        job = self.job
        if job.result is not None:
            raise ValueError(f"job {job.job_id} is over: {state_name(job)}")
        job.log("stop_requested", checkpoint=bool(checkpoint))
        job.inbox.put(StopRequested(bool(checkpoint)))
        return "stop requested: the job ends at the next safe point, with a checkpoint there"

    def preemption_notice(self, actor_id: str, deadline_s: float | None = None, source: str = "drill") -> None:
        """Worker `actor_id` goes in `deadline_s` (a SIGTERM it caught, a drill)."""
        self.job.log("preemption_notice", actor_id=actor_id, deadline_s=deadline_s, source=source)
        self.job.inbox.put(PreemptionNotice(actor_id))

    def node_notice(self, node: str, source: str, deadline_at: float | None, detail: str, ack: tuple = ()) -> None:
        """A watcher says `node` goes by `deadline_at` (epoch seconds; None: unknown, soon)."""
        self.job.inbox.put(NodeNotice(node, Notice(source, deadline_at, detail, tuple(ack))))

    def watcher_note(self, node: str, message: str, problem: bool = True) -> None:
        """What a node's watcher could not read or reach (it says each thing once), or that the node
        has no cloud metadata server (problem False: kept in the log, not shown)."""
        self.job.log("watcher", node=node, message=message, problem=problem)

    # ---- notes from the workers (rank 0's, but for warnings) ---------------------------------------

    def checkpoint_note(self, actor_id: str, directory: str) -> None:
        """Rank 0 committed a checkpoint just now (its writer's thread tells, whatever training does)."""
        self.job.checkpoint_committed(directory)

    def restored_note(self, generation: int, directory: str, step: int) -> None:
        """Rank 0 restored a checkpoint just now (a recovery's or a resume's): logged by the loop."""
        self.job.inbox.put(functools.partial(self.job.checkpoint_restored, generation, directory, step))

    def worker_warning(self, actor_id: str, message: str) -> None:
        """A Python warning a worker showed (worker/warnings_relay.py): one `warning` event, a line in
        the driver's output, and one summary entry per distinct message, whichever workers said it."""
        self.job.record.warn(message, actor_id=actor_id)

    def generation_stepped(self, number: int) -> None:
        self.job.inbox.put(GenerationStepped(number, time.time()))

    def progress_note(self, generation: int, step: int, loss: float | None, step_seconds: float, at: float,
                      checkpoint: str | None = None, losses: tuple = ()) -> None:
        """`losses`: (step, loss) of every step since rank 0's last note, for the trackers."""
        self.job.record.progress(step, loss, step_seconds, at, checkpoint, losses, self.job.state.generation)

    def replicas_note(self, generation: int, cadence: dict) -> None:
        """Rank 0 says the replica cadence its generation agreed on (elastic.replicate_every = "auto":
        worker/cadence_meter.py), with its measured cost."""
        self.job.record.replicas_agreed(generation, cadence)

    def eval_note(self, generation: int, result: dict) -> None:
        """Rank 0 evaluated the weights after `result["step"]` steps (worker/evaluation.py)."""
        self.job.record.evaluated(generation, result)

    # ---- views -------------------------------------------------------------------------------------

    def status(self) -> dict:
        return status_of(self.job)

    def progress(self, cursor: int) -> dict:
        """For a driver's progress line: the live figures, the events since `cursor`, and whether
        the job is over (then result() has its outcome)."""
        return progress_of(self.job, cursor, self._done.is_set())

    def liveness(self) -> dict:
        """What the heartbeat listener saw: how many workers it heard, its longest pause."""
        return self.job.watch.liveness()

    def result(self, timeout_s: float | None = None) -> dict | None:
        """The job's outcome once it is over (None if still running after `timeout_s`): ok, error,
        summary (as written to summary.json) and, on success, the final checkpoint (the weights) by URI."""
        if not self._done.wait(timeout_s):
            return None
        self._collected.set()
        return self.job.result
