"""The status record a live coordinator publishes as a file (coordinator/status_file.py) and what a
client over the dashboard's address accepts of it (service/published_status.py).

Oracles: the record the builder made, byte for byte, whatever moment a reader looks; a record accepted
only when it is whole, the job's, the live coordinator's own and recent."""

import json
import threading
import time
import urllib.parse

import pytest

from elastic_zero.coordinator.status_file import (LONGEST_PERIOD_S, MAX_SHARE, PUBLISH_EVERY_S, StatusFile,
                                                  publish_period)
from elastic_zero.observe.live import status_file_name, status_record
from elastic_zero.service import published_status
from elastic_zero.service.published_status import (FUTURE_SLACK_S, STALE_S, dashboard_time, live_coordinator,
                                                   read_published, usable_record)

pytestmark = pytest.mark.unit


def _record(job_id="j1", pid=4242, as_of=1000.0, step=3):
    return status_record(job_id=job_id, state="running", step=step, coordinator={"pid": pid, "node_ip": "n", "node": "x"},
                         as_of=as_of)


def test_publishing_takes_at_most_its_share_of_a_core_and_never_goes_stale():
    assert publish_period(0.001) == PUBLISH_EVERY_S
    assert publish_period(0.1) == pytest.approx(0.1 / MAX_SHARE)  # a large job's record: written less often
    assert publish_period(0.1) * MAX_SHARE >= 0.1
    assert publish_period(5.0) == LONGEST_PERIOD_S and STALE_S >= 3 * LONGEST_PERIOD_S  # readers never see it stale


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
    deadline = time.monotonic() + 60
    try:
        while len(seen) < 300:
            assert time.monotonic() < deadline, f"{len(seen)} records read in 60 s"
            try:
                text = open(board.path).read()
            except FileNotFoundError:  # not written yet
                continue
            seen.append(json.loads(text))  # never half a record
    finally:
        stop.set()
        writer.join()
    assert all(r["job_id"] == "j1" for r in seen) and seen[-1]["step"] >= seen[0]["step"]
    assert warnings == [] and [p.name for p in tmp_path.rglob("*.partial")] == []


def test_the_final_record_is_the_last_whatever_the_periodic_thread_is_doing(tmp_path):
    building, release = threading.Event(), threading.Event()

    def slow_build():  # the periodic thread, caught in the middle of a record as the job ends
        building.set()
        release.wait(10)
        return _record(step=1)

    board = StatusFile(str(tmp_path), "j1", slow_build, [].append)
    board.start()
    assert building.wait(10)
    stopper = threading.Thread(target=board.stop, args=(_record(step=-7),))
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # it waits for the record being built...
    release.set()
    stopper.join(10)
    assert json.loads(open(board.path).read())["step"] == -7  # ...which is then overwritten by the final one

    early = StatusFile(str(tmp_path / "early"), "j1", lambda: _record(step=1), [].append)
    early.stop(_record(step=-7))  # a job over before its publisher started (a restarted coordinator's)
    early.start()
    time.sleep(0.1)
    assert json.loads(open(early.path).read())["step"] == -7


def test_no_final_record_leaves_no_file_and_a_killed_writers_leftovers_go(tmp_path):
    board = StatusFile(str(tmp_path), "j1", _record, [].append)
    board.write()
    left = tmp_path / (status_file_name("j1") + ".x1y2.partial")
    left.write_text("{half")
    board.start()
    assert not left.exists()
    board.stop(None)  # the last record could not be built: clients must not read "running" from the file
    assert not (tmp_path / status_file_name("j1")).exists()
    StatusFile(str(tmp_path), "never", _record, [].append).stop(None)  # never written: nothing to say
    warnings = []
    stuck = StatusFile(str(tmp_path), "j2", _record, warnings.append)
    (tmp_path / status_file_name("j2")).mkdir()  # something there that cannot be removed as a file
    stuck.stop(None)
    assert len(warnings) == 1 and "cannot be removed" in warnings[0]


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
    assert usable_record(good, "j1", 4242, now=1000.0 - FUTURE_SLACK_S + 0.5)["step"] == 3  # the Date's whole second
    assert usable_record(good, "j1", 4242, now=1000.0 - FUTURE_SLACK_S - 1) is None  # from a clock ahead
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


class _Answer:
    def __init__(self, status_code=200, body=b"", headers=None):
        self.status_code, self.content, self.headers = status_code, body, headers or {}

    def json(self):
        return json.loads(self.content)


class _Dashboard:
    """What `_do_request` of a JobSubmissionClient would return, by path."""

    def __init__(self, actors, files, date="Thu, 01 Jan 1970 00:16:41 GMT"):  # 1001 s
        self.actors, self.files, self.date, self.asked = actors, files, date, []

    def _do_request(self, method, path, timeout):
        self.asked.append((method, path, timeout))
        where, _, query = path.partition("?")
        params = urllib.parse.parse_qs(query)
        if where == "/api/v0/actors":
            body = {"data": {"result": {"result": self.actors}}}
            return _Answer(200, json.dumps(body).encode(), {"Date": self.date})
        name = params["filename"][0]
        if where == "/api/v0/logs/file" and (params["node_id"][0], name) in self.files:
            return _Answer(200, self.files[(params["node_id"][0], name)].encode(), {"Date": self.date})
        return _Answer(500, b"A file is not found")


def test_a_client_reads_the_live_coordinators_file_on_its_node_and_nothing_else():
    coordinator = {"state": "ALIVE", "ray_namespace": "elastic_zero", "pid": 4242, "node_id": "n1"}
    name = status_file_name("j1")
    dash = _Dashboard([coordinator], {("n1", name): json.dumps(_record())})
    record = read_published(dash, "j1", "elastic-zero:j1", "elastic_zero", ray_job_id="02000000")
    assert record["step"] == 3
    (_, actors, timeout), (_, logs, _) = dash.asked
    filters = urllib.parse.parse_qs(actors.partition("?")[2])
    # the state and the Ray job are filtered by Ray's GCS, so the answer does not grow with the cluster
    assert list(zip(filters["filter_keys"], filters["filter_values"])) == [
        ("state", "ALIVE"), ("job_id", "02000000"), ("name", "elastic-zero:j1")]
    assert set(filters["filter_predicates"]) == {"="} and timeout <= published_status.BUDGET_S
    # a restarted coordinator (pid 5151) that has not written yet: its predecessor's file is not used
    assert read_published(_Dashboard([{**coordinator, "pid": 5151}], dash.files), "j1", "elastic-zero:j1",
                          "elastic_zero") is None
    # its file on another node, none written, none alive, the dashboard's clock past the record's age
    assert read_published(_Dashboard([{**coordinator, "node_id": "n2"}], dash.files), "j1", "elastic-zero:j1",
                          "elastic_zero") is None
    assert read_published(_Dashboard([coordinator], {}), "j1", "elastic-zero:j1", "elastic_zero") is None
    assert read_published(_Dashboard([], dash.files), "j1", "elastic-zero:j1", "elastic_zero") is None
    late = _Dashboard([coordinator], dash.files, date="Thu, 01 Jan 1970 00:17:31 GMT")  # 1051 s
    assert read_published(late, "j1", "elastic-zero:j1", "elastic_zero") is None


def test_a_client_that_cannot_read_the_record_in_time_falls_back_without_raising(monkeypatch):
    class Refusing:
        def _do_request(self, method, path, timeout):
            raise RuntimeError("Authentication failed")  # what Ray's AuthenticationError says (a RayError)

    assert read_published(Refusing(), "j1", "elastic-zero:j1", "elastic_zero") is None
    monkeypatch.setattr(published_status, "BUDGET_S", 0.0)
    dash = _Dashboard([], {})
    assert read_published(dash, "j1", "elastic-zero:j1", "elastic_zero") is None and dash.asked == []
    assert dashboard_time(_Answer(headers={"Date": "Thu, 01 Jan 1970 00:16:41 GMT"})) == 1001.0
    assert abs(dashboard_time(_Answer()) - time.time()) < 5  # no Date: this machine's clock


def test_a_starting_publisher_removes_the_files_of_coordinators_that_ended_and_nothing_else(tmp_path):
    """A long-lived cluster's log directory keeps no record of a job whose coordinator is gone (no
    reader takes one). The oracle: a process that ended (its pid) against this one, alive."""
    import subprocess
    import sys

    from elastic_zero.coordinator.status_file import remove_orphans

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    folder = tmp_path / "elastic_zero"
    folder.mkdir()
    files = {name: folder / f"{name}.status.json" for name in ("gone", "alive", "odd")}
    files["gone"].write_text(json.dumps(_record("gone", pid=ended.pid)))
    files["alive"].write_text(json.dumps(_record("alive", pid=__import__("os").getpid())))
    files["odd"].write_text("[1, 2]")  # not a record: left alone
    (folder / "notes.txt").write_text("not a status file")
    board = StatusFile(str(tmp_path), "mine", lambda: _record("mine", pid=ended.pid), lambda m: None)
    board.start()
    board.stop(_record("mine", pid=ended.pid))
    assert sorted(p.name for p in folder.iterdir()) == ["alive.status.json", "mine.status.json", "notes.txt",
                                                        "odd.status.json"]
    assert remove_orphans(str(folder), keep="") == [str(folder / "mine.status.json")]  # its own, once ended
