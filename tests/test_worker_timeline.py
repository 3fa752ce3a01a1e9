"""Each worker's way in, from the job's events (observe/worker_timeline.py). Oracle: an autoscaled
replacement's events as the coordinator writes them (tests/test_autoscaler.py's run)."""

from elastic_zero.observe.worker_timeline import still_here, worker_timeline

EVENTS = [
    {"t": 0.1, "event": "spawn", "count": 2, "actor_ids": ["w0", "w1"]},
    {"t": 9.0, "event": "worker_ready", "actor_id": "w0", "node": "n1", "node_up_t": 4.0},
    {"t": 9.5, "event": "worker_ready", "actor_id": "w1", "node": "n2", "node_up_t": 5.0},
    {"t": 9.6, "event": "generation_start", "generation": 0, "workers": ["w0", "w1"]},
    {"t": 20.0, "event": "worker_lost", "actor_id": "w1"},
    {"t": 20.0, "event": "retire", "actor_ids": ["w1"]},
    {"t": 20.1, "event": "generation_start", "generation": 1, "workers": ["w0"]},
    # the requests went out at 20.15, before the event was written (an autoscaler may answer between)
    {"t": 20.2, "event": "spawn", "count": 1, "actor_ids": ["w2"], "asked_t": 20.15},
    {"t": 22.5, "event": "worker_ready", "actor_id": "w2", "node": "n3", "node_up_t": 21.9},
]


def test_a_replacement_is_asked_for_its_node_comes_up_and_it_waits_to_join():
    timeline = worker_timeline(EVENTS)
    assert [w["actor_id"] for w in timeline] == ["w0", "w1", "w2"]
    assert timeline[1]["gone"] == "lost" and timeline[1]["joined_generation"] == 0
    assert timeline[2] == {"actor_id": "w2", "asked_t": 20.15, "node": "n3", "node_up_t": 21.9, "ready_t": 22.5,
                           "joined_t": None, "joined_generation": None, "gone": None}
    here = still_here(timeline)
    assert [w["actor_id"] for w in here] == ["w0", "w2"]
    joined = worker_timeline(EVENTS + [{"t": 23.0, "event": "generation_start", "generation": 2,
                                        "workers": ["w0", "w2"]}])
    assert joined[2]["joined_t"] == 23.0 and joined[2]["joined_generation"] == 2 and joined[0]["joined_t"] == 9.6


def test_a_log_written_before_spawns_named_their_workers_counts_them():
    old = [{"t": 0.0, "event": "spawn", "count": 2}, {"t": 1.0, "event": "spawn", "count": 1}]
    assert [(w["actor_id"], w["asked_t"]) for w in worker_timeline(old)] == [("w0", 0.0), ("w1", 0.0), ("w2", 1.0)]


def test_a_restarted_coordinators_predecessors_workers_are_gone():
    events = EVENTS[:4] + [{"t": 30.0, "event": "coordinator_restarted", "restarts": 1},
                           {"t": 30.5, "event": "spawn", "count": 1, "actor_ids": ["w0"]}]
    assert [(w["actor_id"], w["asked_t"]) for w in still_here(worker_timeline(events))] == [("w0", 30.5)]


def test_a_worker_that_could_not_start_is_gone():
    events = [{"t": 0.0, "event": "spawn", "count": 1, "actor_ids": ["w0"]},
              {"t": 3.0, "event": "worker_start_failed", "actor_id": "w0", "error": "x"}]
    assert worker_timeline(events)[0]["gone"] == "start_failed" and still_here(worker_timeline(events)) == []


def test_workers_taken_over_by_a_restarted_coordinator_are_still_here():
    events = EVENTS[:4] + [{"t": 30.0, "event": "coordinator_restarted", "restarts": 1, "resume": "workers' memory"},
                           {"t": 30.1, "event": "generation_taken_over", "generation": 0, "step": 0,
                            "workers": ["w0", "w1"]}]
    assert [w["actor_id"] for w in still_here(worker_timeline(events))] == ["w0", "w1"]
