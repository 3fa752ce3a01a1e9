"""The service's pure parts, without a cluster: submissions, control answers, the token's source,
one-line errors, the live figures and the status schema, the progress lines, the event log, and
the filter of Ray's worker-death notes."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys

import pytest

from elastic_zero.observe.event_log import EventLog
from elastic_zero.observe.live import STATUS_KEYS, LiveProgress, last_events, status_record, world_size_history
from elastic_zero.observe.progress import ProgressView, describe, progress_text
from elastic_zero.observe.ray_noise import is_worker_death_note, quiet_worker_deaths
from elastic_zero.service.auth import explain, token_source
from elastic_zero.service.submission import (
    CONTROL_MARK, SPEC_ENV, control_answer, control_entrypoint, job_entrypoint, job_runtime_env, new_job_id,
    read_control_answer,
)


def test_job_ids_entrypoints_and_runtime_envs():
    assert new_job_id("my job/1", "abc123") == "my-job-1-abc123"
    assert new_job_id("???") != new_job_id("???")  # random suffixes: ids are never reused
    entry = job_entrypoint("tiny-1", None)
    assert entry.startswith("python -m elastic_zero.cli run") and "--run-dir ~/elastic-zero/runs/tiny-1" in entry
    quoted = shlex.split(job_entrypoint("tiny-1", "/data/my runs/x"))
    assert quoted[quoted.index("--run-dir") + 1] == "/data/my runs/x"
    assert quoted[quoted.index("--spec-env") + 1] == SPEC_ENV and quoted[quoted.index("--job-id") + 1] == "tiny-1"
    env = job_runtime_env({"name": "t", "train": {"steps": 3}}, "/w", excludes=["big/"])
    assert json.loads(env["env_vars"][SPEC_ENV]) == {"name": "t", "train": {"steps": 3}}
    assert env["working_dir"] == "/w" and "runs/" in env["excludes"] and "big/" in env["excludes"]
    assert "working_dir" not in job_runtime_env({}, None)


def test_control_answers_round_trip_through_a_log():
    argv = shlex.split(control_entrypoint("scale", "j 1", workers=3))
    assert argv[:2] == ["python", "-c"] and argv[3:5] == ["scale", "j 1"] and json.loads(argv[5]) == {"workers": 3}
    # the entrypoint as the cluster runs it, warnings as errors (as `-m` it warned on every run); an
    # operation it does not know is refused before it looks for a cluster, in one marked line
    ran = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", *argv[1:3], "nope", "j", "{}"],
                         capture_output=True, text=True, timeout=60, cwd="/")
    answer = read_control_answer(ran.stdout)
    assert ran.returncode == 0 and answer["error"] == "unknown control operation 'nope'; known: status, scale, stop", \
        (ran.stdout, ran.stderr[-2000:])
    logs = "some noise\n" + control_answer({"a": 1}) + "\ntrailing\n"
    assert read_control_answer(logs) == {"ok": True, "value": {"a": 1}, "error": None, "missing": False}
    assert read_control_answer("Traceback ...\n") is None
    refused = read_control_answer(control_answer(error="outside [1, 4]"))
    assert refused["ok"] is False and refused["error"] == "outside [1, 4]"
    assert control_answer(error="x", missing=True).startswith(CONTROL_MARK)


def test_the_token_is_found_where_rays_cli_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    assert token_source() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert token_source() == str(tmp_path / ".ray" / "auth_token")
    (tmp_path / "other").write_text("t")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "other"))
    assert token_source() == str(tmp_path / "other")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert token_source() == "RAY_AUTH_TOKEN"


def test_use_cluster_token_turns_token_mode_on_only_when_unset(tmp_path):
    # in a child: Ray caches its mode per process
    code = ("import os; from elastic_zero.service.auth import use_cluster_token as u; "
            "print(u(), os.environ.get('RAY_AUTH_MODE'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    run = lambda **extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,  # noqa: E731
                                         text=True, timeout=120).stdout.split()
    assert run() == ["None", "None"]
    assert run(RAY_AUTH_TOKEN="abc") == ["RAY_AUTH_TOKEN", "token"]
    assert run(RAY_AUTH_TOKEN="abc", RAY_AUTH_MODE="disabled") == ["None", "disabled"]


def test_cluster_failures_are_one_line_saying_what_to_do():
    a = "http://h:8265"
    missing = explain(RuntimeError("Authentication required: Unauthorized: Missing authentication token\n\nmore"), a)
    assert "requires a token" in missing and "RAY_AUTH_MODE=token" in missing and "\n" not in missing
    wrong = explain(RuntimeError("Authentication failed: Forbidden: Invalid authentication token\n\nx"), a)
    assert "rejected the token" in wrong and "\n" not in wrong
    down = explain(ConnectionError("Failed to connect to Ray at address: http://h:8265."), a)
    assert down.startswith("cannot reach the Ray dashboard at http://h:8265")
    gcs = explain(ConnectionError("Failed to connect to GCS at address 10.0.0.1:6379"), "10.0.0.1:6379")
    assert gcs.startswith("cannot reach the Ray cluster at 10.0.0.1:6379") and "GCS address" in gcs
    assert explain(RuntimeError("boom\nstack"), a) == "boom (Ray cluster at http://h:8265)"


def test_live_figures_rate_and_eta():
    live = LiveProgress(global_batch=8, steps=100)
    assert live.samples_per_s() is None and live.eta_s() is None
    live.note(10, 2.0, 0.1, at=100.0)
    live.note(20, 1.5, 0.1, at=102.0)
    assert live.samples_per_s() == pytest.approx(40.0) and live.eta_s() == pytest.approx(80 * 8 / 40)
    live.note(15, 1.7, 0.1, at=103.0)  # a recovery went back: the rate starts over
    assert live.samples_per_s() is None and live.step == 15
    live.note(16, None, 0.1, at=103.5)  # a generation's first step: its loss is read during the next
    assert live.step == 16 and live.loss == 1.7
    for i in range(30):  # the window keeps the last RATE_WINDOW_S seconds
        live.note(15 + i, 1.0, 0.1, at=103.0 + i)
    assert live.samples_per_s() == pytest.approx(8.0)


def test_the_status_record_has_exactly_the_documented_keys():
    record = status_record(job_id="j", state="running", step=3)
    assert list(record) == list(STATUS_KEYS) and record["schema"] == 7 and record["loss"] is None
    with pytest.raises(KeyError, match="not in the status schema"):
        status_record(jobid="typo")
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "service.md")).read()
    for key in STATUS_KEYS:  # every key is documented
        assert f"`{key}`" in docs, key
    events = [{"event": "decision"}, {"event": "worker_lost", "actor_id": "w1"}, {"event": "spawn"}]
    assert last_events(events) == [{"event": "worker_lost", "actor_id": "w1"}]


def test_the_world_size_history_takes_a_restored_checkpoints_step_once_it_was_read():
    """A generation that restores a checkpoint begins at a step known only once it has read it (the
    status said "at step ?" for the rest of the job, where the summary said the step)."""
    def start(generation, step, workers, **more):
        return {"event": "generation_start", "generation": generation, "step": step, "workers": workers, **more}

    records = [start(0, 0, ["w0", "w1"], source="init", resume="latest"),
               {"event": "checkpoint_restored", "generation": 0, "directory": "d/step-0000000020", "step": 20},
               start(1, 31, ["w0"], source="snapshot"), start(2, -1, ["w0", "w2"], source="checkpoint")]
    assert world_size_history(records) == [[20, 2], [31, 1], [None, 2]]  # generation 2 has not read it yet
    records.append({"event": "checkpoint_restored", "generation": 2, "directory": "d/step-0000000030", "step": 30})
    assert world_size_history(records) == [[20, 2], [31, 1], [30, 2]]
    fresh = [start(0, 0, ["w0"], source="init", resume="latest")]  # nothing committed to resume: not read
    assert world_size_history(fresh) == [[None, 1]]
    # ended without a restore, it found nothing to resume: it began at step 0
    fresh += [{"event": "generation_end", "generation": 0}, start(1, 12, ["w0", "w1"], source="live")]
    assert world_size_history(fresh) == [[0, 1], [12, 2]]
    # a telling without the step does not hide one with it; a start over that read the resumed checkpoint
    records += [{"event": "checkpoint_restored", "generation": 2, "directory": "d/step-0000000030", "step": None},
                start(3, 0, ["w0", "w3"], source="restart"),
                {"event": "checkpoint_restored", "generation": 3, "directory": "d/step-0000000020", "step": 20}]
    assert world_size_history(records) == [[20, 2], [31, 1], [30, 2], [20, 2]]


def test_the_status_text_tells_a_worker_starting_from_one_ready_outside_the_generation():
    """A standby (or a joiner before its safe point) is ready, not starting; one whose hello has not
    come is starting. Both are outside the generation's members."""
    from elastic_zero.cli import format_status

    worker = {"actor_id": "w2", "asked_t": 1.0, "node": "n", "node_up_t": 0.5, "ready_t": None, "joined_t": None,
              "joined_generation": None, "gone": None}
    record = status_record(job_id="j", name="tiny", state="running", generation=0, world_size=2, target_workers=2,
                           min_workers=1, max_workers=2, step=3, steps=10, members=[], world_size_history=[[0, 2]],
                           recoveries=0, reconfigurations=0, restarts=0,
                           workers=[worker, {**worker, "actor_id": "w3", "ready_t": 4.0}],
                           standby={"asked": 2, "kept": 1, "short_for_room": 1})
    lines = format_status(record).splitlines()
    assert [line.split(":")[0] for line in lines if "w2" in line or "w3" in line] == \
        ["starting", "ready, outside the generation"]
    assert "standby workers: 1 kept of 2 asked, 1 retired for room" in lines
    record["standby"] = {"asked": 0, "kept": 0, "short_for_room": 0}  # none asked: no line
    assert not [line for line in format_status(record).splitlines() if line.startswith("standby")]


def test_event_lines_and_progress_lines():
    assert describe({"event": "worker_lost", "actor_id": "w1"}) == "worker w1 lost"
    assert describe({"event": "decision", "reason": "x"}) is None
    line = describe({"event": "generation_start", "generation": 2, "step": 10, "source": "snapshot", "workers": ["a", "b"]})
    assert line == "recovery: generation 2 goes on from step 10 on 2 workers (from memory)"
    assert "w2 leaving" in describe({"event": "generation_start", "generation": 3, "step": 11, "source": "live",
                                     "workers": ["a"], "leaving": ["w2"]})
    assert describe({"event": "preemption_notice", "actor_id": "w0", "deadline_s": 30}) == \
        "preemption notice for w0 (deadline 30 s)"
    assert describe({"event": "preemption_notice", "actor_id": "w3", "deadline_s": 25.5, "source": "sigterm"}) == \
        "preemption notice from sigterm for w3 (deadline 25.5 s)"
    assert describe({"event": "preemption_notice", "node": "6bb0bd6116f5aa01", "source": "ray-drain", "deadline_s": None,
                     "detail": "", "actor_ids": ["w1", "w2"]}) == \
        "preemption notice from ray-drain for node 6bb0bd6116f5: w1, w2 to leave at a safe point"
    assert describe({"event": "worker_lost", "actor_id": "w1", "silent_s": 1.04}) == "worker w1 lost (silent for 1.0 s)"
    assert describe({"event": "worker_lost", "actor_id": "w5", "during": "ready", "error": "its process ended"}) == \
        "worker w5 lost while it waited, ready, outside the generation (its process ended)"
    assert describe({"event": "watcher", "node": "ab" * 20, "message": "no metadata server", "problem": False}) is None
    assert describe({"event": "watcher", "node": "ab" * 20, "message": "a GCP preempted value of 'x'",
                     "problem": True}) == "preemption watcher on node abababababab: a GCP preempted value of 'x'"
    assert describe({"event": "eval", "step": 20, "loss": 2.5, "perplexity": 12.18, "metrics": {"acc": 0.5},
                     "samples": 64}) == "eval at step 20: loss 2.5000, perplexity 12.18, acc 0.5 (64 samples)"
    p = {"step": 5, "steps": 10, "loss": 1.23456, "samples_per_s": 40.0, "world_size": 3, "eta_s": 75.0}
    assert progress_text(p) == "step 5/10  loss 1.2346  40.0 samples/s  world 3  ETA 1:15"
    assert progress_text({**p, "eval_loss": 1.5}) == "step 5/10  loss 1.2346  eval 1.5000  40.0 samples/s  world 3  ETA 1:15"
    clock = iter([0.0, 1.0, 11.0, 12.0]).__next__
    out = io.StringIO()
    view = ProgressView(out, tty=False, clock=clock)
    view.update(p)  # the first line
    view.event({"event": "worker_lost", "actor_id": "w1", "t": 0})
    view.update({**p, "step": 6})  # within PLAIN_EVERY_S: no line
    view.update({**p, "step": 7})  # after it: a line
    view.update({**p, "step": 10})  # the last step: always a line
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        progress_text(p), "worker w1 lost", progress_text({**p, "step": 7}), progress_text({**p, "step": 10})]
    tty = io.StringIO()
    bar = ProgressView(tty, tty=True)
    bar.update(p)
    bar.event({"event": "worker_lost", "actor_id": "w1", "t": 0})
    bar.close()
    assert "worker w1 lost" in tty.getvalue() and "5/10" in tty.getvalue() and "world 3" in tty.getvalue()


def test_the_event_log_survives_its_writer(tmp_path):
    log = EventLog(str(tmp_path))
    log.add("job_start", name="x")
    log.add("worker_lost", actor_id="w1")
    with open(log.path, "a") as fh:
        fh.write('{"t": 1, "event": "tor')  # the writer died mid-line
    again = EventLog(str(tmp_path), go_on=True)
    assert [r["event"] for r in again.records] == ["job_start", "worker_lost"] and again.count("worker_lost") == 1
    again.add("coordinator_restarted", restarts=1)
    assert [json.loads(line)["event"] for line in open(log.path)] == ["job_start", "worker_lost", "coordinator_restarted"]
    fresh = EventLog(str(tmp_path))  # a new job in the same directory starts a new log
    assert fresh.records == [] and open(log.path).read() == ""


def test_only_rays_worker_death_notes_are_dropped(monkeypatch, capsys):
    import ray._private.worker as ray_worker

    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, *a, **k: print("|".join(data["lines"])))
    note = {"pid": "raylet", "lines": ["A worker died or was killed while executing a task by an unexpected system error."]}
    other = {"pid": "raylet", "lines": ["the node is out of memory"]}
    assert is_worker_death_note(note) and not is_worker_death_note(other)
    assert not is_worker_death_note({"pid": 1234, "lines": note["lines"]})  # a worker's own output stays
    assert quiet_worker_deaths() and quiet_worker_deaths()  # twice: wrapped once
    ray_worker.print_to_stdstream(note, ignore_prefix=False)
    ray_worker.print_to_stdstream(other, ignore_prefix=False)
    assert capsys.readouterr().out == "the node is out of memory\n"


def test_every_metric_is_documented():
    from elastic_zero.observe.metrics import METRICS

    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "service.md")).read()
    for name, (kind, _) in METRICS.items():
        assert f"| `{name}` | {kind} |" in docs, name
