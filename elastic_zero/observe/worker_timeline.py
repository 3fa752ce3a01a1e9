"""Each worker's way into the job, read from the job's events: when the job asked for it (its
`spawn`), when its node came up (`worker_ready`'s `node_up_t`: the node's raylet start), when it was
ready, when it joined (the first generation it was a member of), and, once gone, why. On an
autoscaled cluster this is the replacement's timeline: asked -> node up -> ready -> joined."""

from __future__ import annotations


def worker_timeline(records: list[dict]) -> list[dict]:
    """One entry a worker, in the order the job asked for them; a time is None until it happened
    (epoch seconds). A spawn event without `actor_ids` (a log written before they were named) names
    them by the spawner's count, w0, w1, ..."""
    workers: dict[str, dict] = {}
    counted = 0
    for r in records:
        kind = r.get("event")
        if kind == "spawn":
            ids = r.get("actor_ids") or [f"w{counted + i}" for i in range(r.get("count", 0))]
            counted += len(ids)
            for actor_id in ids:
                workers[actor_id] = {"actor_id": actor_id, "asked_t": r.get("asked_t", r["t"]), "node": None, "node_up_t": None,
                                     "ready_t": None, "joined_t": None, "joined_generation": None, "gone": None}
        elif kind == "worker_ready" and r.get("actor_id") in workers:
            w = workers[r["actor_id"]]
            w.update(node=r.get("node"), node_up_t=r.get("node_up_t"), ready_t=r["t"])
        elif kind == "generation_start":
            for actor_id in r.get("workers", ()):
                w = workers.get(actor_id)
                if w is not None and w["joined_t"] is None:
                    w.update(joined_t=r["t"], joined_generation=r.get("generation"))
        elif kind in ("worker_lost", "worker_start_failed") and r.get("actor_id") in workers:
            workers[r["actor_id"]]["gone"] = workers[r["actor_id"]]["gone"] or kind.removeprefix("worker_")
        elif kind == "coordinator_restarted" and r.get("resume") != "workers' memory":
            for w in workers.values():  # its predecessor's workers ended with it (none were taken over)
                w["gone"] = w["gone"] or "coordinator_restarted"
        elif kind == "retire":
            for actor_id in r.get("actor_ids", ()):
                if actor_id in workers:
                    workers[actor_id]["gone"] = workers[actor_id]["gone"] or "retired"
    return list(workers.values())


def still_here(timeline: list[dict]) -> list[dict]:
    """The workers not gone: the members and those still starting."""
    return [w for w in timeline if w["gone"] is None]
