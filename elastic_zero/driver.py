"""The driver of a job: starts its coordinator actor and follows it to the end.

On a cluster (an address given) the coordinator is a detached named actor: the job goes on if
this driver dies, and status/scale/stop reach it by name. A driver that is told to stop (SIGTERM,
as `ray job stop` sends, or Ctrl-C) takes the job down with it. If the coordinator's process dies,
this driver starts it again (COORDINATOR_RESTARTS times in a row at most with no step trained in
between: a coordinator that dies as it starts is not started for ever), and it takes over the workers,
which outlive it, and the generation they were in, from their memory (coordinator/takeover.py); with
none left, it resumes from the latest checkpoint by itself.

Why the driver and not Ray (max_restarts): Ray's memory monitor kills retriable actors first and,
among the rest, the newest. A coordinator Ray may restart would be the first victim on a node short
of memory, and the whole job (its workers die with it) would go back to a checkpoint; one it may
not, started before its workers, is the last.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from elastic_zero.observe.progress import ProgressView
from elastic_zero.observe.ray_noise import quiet_worker_deaths
from elastic_zero.job.spec import JobSpec, SpecError

HEAD_RESOURCE = "node:__internal_head__"
COORDINATOR_RESTARTS = 3  # in a row: with no generation ending past its first step in between
POLL_S = 0.5
REATTACH_S = 120.0  # how long a coordinator may go unanswering (its process alive) before the job is given up


def drive(job: JobSpec, tables: dict, job_id: str, run_dir: str, run_config, started_at: float) -> dict:
    """The job's outcome: {"ok", "error", "summary", "checkpoint", "final_checkpoint"}. `job` as
    job/prepare.py prepared it, `tables` as it sealed it."""
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE

    if not run_config.worker_logs:
        quiet_worker_deaths()
    own_ray = not ray.is_initialized()
    if own_ray:
        common = dict(namespace=NAMESPACE, logging_level="ERROR", log_to_driver=run_config.worker_logs)
        if run_config.address:
            ray.init(address=run_config.address, **common)
        else:  # an embedded local Ray: logical CPUs for every worker the job may have
            cpus = max(os.cpu_count() or 1, job.elastic.max_workers + job.elastic.standby_workers + 1)
            ray.init(num_cpus=cpus, include_dashboard=False, **common)
    view = ProgressView() if run_config.progress else None
    restore = _stop_on_sigterm()
    try:
        from elastic_zero.job.preflight import check_cluster

        check_cluster(job, ray.cluster_resources())
        detached = bool(run_config.address)
        followed = [_start_coordinator(tables, job_id, run_dir, started_at, detached)]
        try:
            return _follow(followed, view, lambda: _start_coordinator(tables, job_id, run_dir, started_at, detached,
                                                                      restarted=True))
        finally:  # collected, or this driver was stopped: either way the coordinator goes, and its workers
            try:
                ray.kill(followed[0], no_restart=True)
            finally:
                _end_workers(job_id)
    finally:
        restore()
        if view is not None:
            view.close()
        if own_ray:
            ray.shutdown()


def _start_coordinator(tables: dict, job_id: str, run_dir: str, started_at: float, detached: bool,
                       restarted: bool = False):
    """`tables`: the job's spec, its user values sealed (sealed.py)."""
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, Coordinator, coordinator_name

    name = coordinator_name(job_id)
    _clear_finished(name, job_id)
    options = dict(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=16, max_restarts=0)
    # on the head node (where a submitted job's driver runs too; the cluster ends with it anyway),
    # not on a worker node that may be preempted or lost: Ray's documented way to pin to the head
    options["resources"] = {HEAD_RESOURCE: 0.001}
    if detached:
        options["lifetime"] = "detached"
    deadline = time.monotonic() + 10
    while True:
        try:
            return ray.remote(Coordinator).options(**options).remote(tables, job_id, run_dir, started_at, restarted)
        except ValueError:  # the name of a coordinator just killed is released a moment later
            if time.monotonic() > deadline:
                raise SpecError(f"a job with id {job_id!r} is already running on this Ray cluster") from None
            time.sleep(0.2)


def _clear_finished(name: str, job_id: str) -> None:
    """A coordinator of a job that is over may linger under the name: it goes. One that runs stays,
    and this job may not start."""
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE

    try:
        existing = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        state = ray.get(existing.status.remote(), timeout=10)["state"]
    except (ray.exceptions.RayError, KeyError):
        state = "gone"
    if state not in ("finished", "failed", "stopped", "gone"):
        raise SpecError(f"a job with id {job_id!r} is already running on this Ray cluster ({state}); "
                        f"stop it, or give this one another name")
    ray.kill(existing, no_restart=True)


def _follow(followed: list, view: ProgressView | None, restart) -> dict:
    """Follow the coordinator in `followed[0]` to the job's end; one that died is replaced by
    `restart()` (in `followed[0]`), COORDINATOR_RESTARTS times in a row at most: a generation that
    ends having trained a step (its events) begins the count again."""
    import ray

    cursor, unreachable_since, restarts = 0, None, 0
    started_at: dict = {}  # generation -> the step it started from (its generation_start event)
    while True:
        actor = followed[0]
        try:
            p = ray.get(actor.progress.remote(cursor), timeout=60)
            unreachable_since = None
        except ray.exceptions.ActorDiedError:
            if restarts == COORDINATOR_RESTARTS:
                return _lost(f"the coordinator died {restarts + 1} times with no step trained in between: not "
                             f"started again ({COORDINATOR_RESTARTS} restarts in a row at most)")
            restarts += 1
            # its replacement takes over its workers (or resumes from the latest checkpoint), and goes
            # on with its predecessor's events (the cursor stays)
            followed[0] = restart()
            continue
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            # unreachable for now (its node's connection, a slow answer): wait for it
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > REATTACH_S:
                return _lost(f"the coordinator did not answer within {REATTACH_S:.0f} s")
            time.sleep(1.0)
            continue
        for record in p["events"]:
            if view is not None:
                view.event(record)
            kind = record.get("event")
            if kind == "generation_start":
                started_at[record["generation"]] = record["step"]
            # a generation that ended past the step it started from trained: the count begins again
            # (one taken over trained under the coordinator that died, whose replacement then worked)
            elif kind == "generation_end" and started_at.get(record["generation"]) is not None and \
                    (record.get("steps_done") or 0) > max(started_at[record["generation"]], 0):
                restarts = 0
        if view is not None:
            view.update(p)
        cursor = p["cursor"]
        if p["done"]:
            return ray.get(actor.result.remote(0))
        time.sleep(POLL_S)


def _end_workers(job_id: str) -> None:
    """The job's workers still alive: detached, they would outlive a coordinator killed with them
    working (a stop, a driver's end) until their wait for a replacement ran out (workforce.py)."""
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name
    from elastic_zero.coordinator.workforce import named_workers

    try:
        for handle in named_workers(coordinator_name(job_id), NAMESPACE).values():
            ray.kill(handle, no_restart=True)
    except (ray.exceptions.RayError, ConnectionError) as exc:  # Ray going away: the job's outcome stands
        print(f"elastic_zero: could not end the job's workers: {exc}", file=sys.stderr)


def _lost(why: str) -> dict:
    return {"ok": False, "error": why, "summary": {"ok": False, "error": why}}


def _stop_on_sigterm():
    """SIGTERM (`ray job stop`, a pod's deletion) ends this driver as Ctrl-C does: through its
    `finally`, which takes the coordinator down. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)
