"""What the outside sees of a job's coordinator: its status (the `status --json` record), its
progress for a driver's progress line, and the last status kept in the cluster's key-value store
once the coordinator is gone. Read from the job's loop (job_loop.py) on the actor's other threads,
while the loop drives the job."""

from __future__ import annotations

import json
import os
import time

import ray

from elastic_zero.observe.live import final_status_key, last_events, status_record, world_size_history
from elastic_zero.observe.worker_timeline import still_here, worker_timeline

NAMESPACE_KV = "elastic_zero"


def state_name(job) -> str:
    """The job's state in one word: starting, running, waiting, stopping, finished, stopped, failed."""
    r = job.result
    if r is not None:
        if not r["ok"]:
            return "failed"
        return "stopped" if "stopped_at_step" in r["summary"] else "finished"
    st = job.state
    if st.stop_requested:
        return "stopping"
    return {"starting": "starting", "running": "running", "waiting": "waiting"}.get(st.phase.value, st.phase.value)


def status_of(job) -> dict:
    """The status record of `job` (a JobLoop)."""
    with job.lock:
        st = job.state
        gen = st.generation
        # (by position: members.index(m) per member took 0.15 s at 1,024, holding the lock the loop decides under)
        members = [{"actor_id": m.actor_id, "rank": r, "node": m.node}
                   for r, m in enumerate(gen.members)] if gen else []
    live = job.record.live
    records = list(job.record.events.records)  # a restarted coordinator's include its predecessors'
    committed = job.record.committed_directories()
    starts = [r for r in records if r.get("event") == "generation_start"]
    newest = live.checkpoint or (committed[-1] if committed else None)  # live: the later of notes and events
    e = job.spec.elastic
    beats = job.watch.beats()
    return status_record(
        job_id=job.job_id, name=job.spec.name, state=state_name(job),
        generation=gen.number if gen else None, world_size=len(members), target_workers=st.target,
        min_workers=e.min_workers, max_workers=e.max_workers, members=members,
        step=live.step, steps=job.spec.train.steps, loss=live.loss, eval=live.eval,
        samples_per_s=_round(live.samples_per_s()), eta_s=_round(live.eta_s()),
        # from the events: counted as each change starts, and across coordinator restarts
        world_size_history=world_size_history(records),
        recoveries=sum(r["source"] in ("snapshot", "checkpoint", "restart") for r in starts),
        reconfigurations=sum(r["source"] == "live" for r in starts), restarts=job.restarts,
        checkpoint=newest, run_dir=job.run_dir,
        coordinator={"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                     "node": ray.get_runtime_context().get_node_id()},
        error=(job.result or {}).get("error"), last_events=last_events(records),
        replicas=job.record.replicas(gen, current=True), workers=still_here(worker_timeline(records)),
        standby={"asked": e.standby_workers, "kept": st.standby, "short_for_room": st.standby_short.count},
        memory={**job.memory.summary(st.memory, job.generations.last_plan),
                "rss_gib": {a: round(p.rss / 2**30, 3) for a, p in sorted(beats.items())
                            if a in job.pool and not p.last_word}},
        as_of=round(time.time(), 3))


def progress_of(job, cursor: int, done: bool) -> dict:
    """For a driver's progress line: the live figures, the events since `cursor`, and whether the job
    is over (`done`, read before the events: every event of a job that is over is in what follows)."""
    events_log, live = job.record.events, job.record.live
    if cursor > len(events_log.records):  # a restarted coordinator that found no log of its predecessor's
        cursor = 0
    events = events_log.since(cursor)
    gen = job.state.generation
    return {"step": live.step, "steps": job.spec.train.steps, "loss": live.loss,
            "eval_loss": (live.eval or {}).get("loss"),
            "samples_per_s": live.samples_per_s(), "eta_s": live.eta_s(),
            "world_size": len(gen.members) if gen else 0,
            "events": events, "cursor": cursor + len(events), "done": done}


def final_status(job_id: str) -> dict | None:
    """The last status record of job `job_id`, if an earlier coordinator of it ended it."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(final_status_key(job_id), namespace=NAMESPACE_KV)
    except Exception:  # noqa: BLE001
        return None
    return json.loads(value) if value else None


def publish_final_status(job_id: str, status: dict) -> None:
    """The last status record goes into the cluster's key-value store: `status` answers from it once
    the coordinator is gone."""
    try:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(final_status_key(job_id), json.dumps(status), namespace=NAMESPACE_KV)
    except Exception:  # noqa: BLE001 - status then falls back to what the Ray job says
        pass


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
