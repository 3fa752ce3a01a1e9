"""The status record a live coordinator publishes as a file (coordinator/status_file.py) and what a
client over the dashboard's address accepts of it (service/published_status.py).

Oracles: the record the builder made, byte for byte, whatever moment a reader looks; a record accepted
only when it is whole, the job's, the live coordinator's own and recent."""

import json
import threading

import pytest

from elastic_zero.coordinator.status_file import MAX_SHARE, PUBLISH_EVERY_S, StatusFile, publish_period
from elastic_zero.observe.live import status_file_name, status_record
from elastic_zero.service.published_status import STALE_S, live_coordinator, usable_record

pytestmark = pytest.mark.unit


def _record(job_id="j1", pid=4242, as_of=1000.0, step=3):
    return status_record(job_id=job_id, state="running", step=step, coordinator={"pid": pid, "node_ip": "n", "node": "x"},
                         as_of=as_of)


def test_publishing_takes_at_most_its_share_of_a_core():
    assert publish_period(0.001) == PUBLISH_EVERY_S
    assert publish_period(0.1) == pytest.approx(0.1 / MAX_SHARE)  # a large job's record: written less often
    assert publish_period(0.1) * MAX_SHARE >= 0.1


def test_a_reader_only_ever_sees_a_whole_record_and_the_final_one_last(tmp_path):
    steps = iter(range(10**9))
    warnings = []
    board = StatusFile(str(tmp_path), "j1", lambda: _record(step=next(steps)), warnings.append)
    seen, stop = [], threading.Event()

    def write_fast():  # the writes a second's period would spread out, back to back
        while not stop.is_set():
            board.write()

    writer = threading.Thread(target=write_fast)
    writer.start()
    try:
        while len(seen) < 300:
            try:
                text = open(board.path).read()
            except FileNotFoundError:  # not written yet
                continue
            seen.append(json.loads(text))  # never half a record
    finally:
        stop.set()
        writer.join()
    assert all(r["job_id"] == "j1" for r in seen) and seen[-1]["step"] >= seen[0]["step"]
    board.start()
    board.stop(final=_record(step=-7))
    assert json.loads(open(board.path).read())["step"] == -7  # the periodic thread is done before the final record
    assert warnings == [] and [p.name for p in tmp_path.rglob("*.partial")] == []


def test_a_record_that_fails_to_build_or_write_is_told_once_and_publishing_goes_on(tmp_path):
    warnings = []
    calls = []

    def build():
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("a bug in a view")
        return _record()

    board = StatusFile(str(tmp_path), "j1", build, warnings.append)
    board.write()
    board.write()
    board.write()
    assert len(warnings) == 1 and "cannot be written" in warnings[0] and "a bug in a view" in warnings[0]
    assert json.loads(open(board.path).read())["job_id"] == "j1"
    (tmp_path / "blocked").write_text("a file where the directory would go")
    blocked = StatusFile(str(tmp_path / "blocked"), "j1", _record, warnings.append)
    blocked.write()
    assert len(warnings) == 2 and str(tmp_path / "blocked") in warnings[1]


def test_a_job_id_with_a_slash_stays_one_file_in_the_directory(tmp_path):
    board = StatusFile(str(tmp_path), "../up/a", _record, [].append)
    board.write()
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")] == [status_file_name("../up/a")]
    assert status_file_name("../up/a").count("/") == 1


def test_only_the_live_coordinators_own_recent_whole_record_is_used():
    good = json.dumps(_record())
    assert usable_record(good, "j1", 4242, now=1001.0)["step"] == 3
    assert usable_record(good, "j1", 4242, now=1000.0 + STALE_S + 1) is None  # stale: its publisher stopped
    assert usable_record(good, "j2", 4242, now=1001.0) is None  # another job's
    assert usable_record(good, "j1", 999, now=1001.0) is None  # an earlier coordinator's, on the same node
    assert usable_record(good[:-5], "j1", 4242, now=1001.0) is None  # not whole
    assert usable_record(json.dumps({"job_id": "j1"}), "j1", 4242, now=1001.0) is None  # another schema
    assert usable_record(json.dumps(_record(as_of=None)), "j1", 4242, now=1001.0) is None
    assert usable_record("[]", "j1", 4242, now=1001.0) is None


def test_the_live_coordinator_is_the_one_alive_actor_of_its_name_in_its_namespace():
    alive = {"state": "ALIVE", "ray_namespace": "elastic_zero", "pid": 1, "node_id": "a"}
    dead = {"state": "DEAD", "ray_namespace": "elastic_zero", "pid": 2, "node_id": "b"}
    elsewhere = {"state": "ALIVE", "ray_namespace": "other", "pid": 3, "node_id": "c"}
    assert live_coordinator([dead, alive, elsewhere], "elastic_zero") is alive
    assert live_coordinator([dead, elsewhere], "elastic_zero") is None
    assert live_coordinator([{**alive, "state": "RESTARTING"}], "elastic_zero") is None
    assert live_coordinator([alive, {**alive, "pid": 9}], "elastic_zero") is None  # two: not one to trust
