"""A coordinator that replaces a lost one finds the workers that outlived it and the generation they
were in, from the workers themselves: each keeps the plan it trained last (worker/actor.py).

The lost coordinator's workers are detached, named after it (workforce.py): the replacement lists
them by name, asks each its last plan, and takes the newest plan's participants over (take_over()):
each stops at its next safe point, or has stopped, and answers with the report the lost coordinator
never heard. Those answers end the generation as its reports would have (generation_run.py), and the
state machine goes on from them: from the members' live shards at a safe point, from the replicas
after a failure, from the checkpoint where memory lacks a shard (state.py, recovery.py)."""

from __future__ import annotations

from typing import NamedTuple

import ray

from elastic_zero.protocol import GenerationPlan, unpack_plan

ASK_S = 10.0  # how long the survivors' last plans are waited for (a quick call; a worker not answering is left out)


class Found(NamedTuple):
    plan: GenerationPlan  # the newest plan a survivor trained
    participants: dict  # its participants alive, actor id -> handle
    others: dict  # the job's other workers alive (spawned, standing by, or left behind): retired


def find_generation(workforce, events: list[dict] = ()) -> Found | None:
    """The newest generation the job's surviving workers were in, or None: no survivor, or none that
    trained (a workforce that cannot list survivors, a simulated one, has none). `events`: the job's
    log; a survivor it never says was ready is still starting and trained nothing: it is not asked,
    for its answer would wait for its start (a replacement spawned for a loss held a take-over for
    ASK_S, the chaos drill). A log that names nobody ready (not read) leaves everyone asked."""
    try:
        survivors = workforce.survivors() if hasattr(workforce, "survivors") else {}
    except ray.exceptions.RayError:  # the cluster's actor list could not be read: none to take over
        return None
    if not survivors:
        return None
    ready = {r["actor_id"] for r in events if r.get("event") == "worker_ready"}
    asked = {handle.last_plan.remote(): actor_id for actor_id, handle in survivors.items()
             if actor_id in ready or not ready}
    answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=ASK_S)
    plans = []
    for ref in answered:
        try:
            packed = ray.get(ref)
        except ray.exceptions.RayError:  # died since it was listed
            continue
        if packed is not None:
            plans.append(unpack_plan(packed))
    if not plans:
        return Found(None, {}, survivors)
    newest = max(plans, key=lambda p: p.number)
    participants = {a: h for a, h in survivors.items() if a in newest.participants}
    return Found(newest, participants, {a: h for a, h in survivors.items() if a not in participants})


def take_over_calls(participants: dict, worker_args: dict, wait_s: float) -> dict:
    """Each participant taken over (take_over() in flight -> actor id): it follows this coordinator's
    store and listener (`worker_args`, as a worker spawned now is given) once its generation is over,
    which it waits `wait_s` for at most."""
    a = worker_args
    return {handle.take_over.remote(a["store_host"], a["store_port"], a["store_secret"], a["heartbeat_port"],
                                    wait_s): actor_id for actor_id, handle in participants.items()}


def take_over(found: Found, pool, watch, generations, worker_args: dict, wait_s: float, events: list[dict]) -> None:
    """`found`'s survivors taken into `pool` (the caller retires those outside its generation), and its
    generation into `generations`, its reports to come from its participants. `events`: the job's log,
    whose spawns name the ids not to give again."""
    pool.adopt({**found.participants, **found.others}, spawned_ids(events))
    for m in found.plan.generation.members:
        if m.actor_id in found.participants:
            watch.worker_at(m.actor_id, m.node)
    generations.take_over(found.plan, take_over_calls(found.participants, worker_args, wait_s))


def carried_over(events: list[dict], workers: int) -> tuple[int, bool, bool]:
    """What the lost coordinator was asked and had not done, from the job's log: (the workers it was
    to keep: the last scale asked of it, else the spec's `workers`; a stop asked and not done; with a
    checkpoint)."""
    asked = [r["workers"] for r in events if r.get("event") == "scale_requested"]
    stops = [r for r in events if r.get("event") == "stop_requested"]
    stopped = any(r.get("event") == "job_stopped" for r in events)
    return (asked[-1] if asked else workers), bool(stops) and not stopped, any(r.get("checkpoint") for r in stops)


def spawned_ids(events: list[dict]) -> list[str]:
    """Every worker id the job's log says was spawned (a dead worker's name may not be free yet)."""
    return [a for r in events if r.get("event") == "spawn" for a in r.get("actor_ids", ())]
