"""Jobs on a real Ray head started here with `ray start` (token auth on, then off), driven through
the CLI and the Python Client as a user would: submit, status (the JSON schema), scale up and down,
metrics, logs, a killed coordinator whose replacement takes its workers over, one of them lost
meanwhile (the takeover with none lost: test_coordinator_takeover.py), a killed driver the job
outlives, a graceful stop with a final checkpoint, and the bad inputs (one line, non-zero exit).

The oracles: the status record's schema; the world size the coordinator reports after each
request; the samples each step consumed (exactly once from the resumed checkpoint on); the
checkpoint the stop wrote, listed by `checkpoint ls` at the step the summary names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from elastic_zero.observe.live import STATUS_KEYS
from elastic_zero.testing.local_cluster import RayHead

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

FACTORY = '''
from elastic_zero.models import build_preset


def build(width=32):
    return build_preset("gpt-tiny", seed=0)
'''
PACED = os.path.join(os.path.dirname(__file__), "paced.py")  # a paced loss, for jobs that run until stopped


def _spec(steps: int, checkpoint_uri: str | None = None, paced: bool = False) -> str:
    ckpt = f'[checkpoint]\nuri = "{checkpoint_uri}"\nevery = 10\nkeep = 3\n' if checkpoint_uri else ""
    loss = 'loss = "paced:loss"' if paced else ""
    return textwrap.dedent(f"""\
        name = "svc"
        [model]
        factory = "mymodels:build"
        [data]
        source = "synthetic"
        [train]
        {loss}
        steps = {steps}
        global_batch = 8
        micro_batch = 4
        [optimizer]
        name = "adamw"
        lr = 1e-3
        [zero]
        stage = 2
        [elastic]
        workers = 2
        min_workers = 1
        max_workers = 4
        """) + ckpt


@pytest.fixture
def workdir(tmp_path):
    """The user's project: a spec and the module its factory lives in, uploaded with the job."""
    (tmp_path / "mymodels.py").write_text(FACTORY)
    shutil.copy(PACED, tmp_path / "paced.py")
    return tmp_path


def _cli(head, cwd, *args, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "elastic_zero.cli", *args], cwd=cwd, env=head.client_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _ray_jobs(head) -> int:
    """How many Ray jobs the head has had (its Jobs API, over HTTP: a control job is one)."""
    request = urllib.request.Request(f"{head.address}/api/jobs/")
    if head.token:
        request.add_header("Authorization", f"Bearer {head.token}")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return len(json.load(answer))


def _ok(result) -> str:
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _one_line_error(result, code: int, *words: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastic-zero: error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def _status(head, cwd, job_id) -> dict:
    """Through the CLI, over a direct connection to the cluster (quicker than a control job; both are tested)."""
    return json.loads(_ok(_cli(head, cwd, "status", job_id, "--json", "--address", head.gcs_address)))


def _until(head, cwd, job_id, what, check, timeout_s=180.0, every_s=1.0) -> dict:
    """Looks through the head's own connected looker (RayHead.job_status: the same record as the
    CLI's `status --json`, which the test asks too), None while the job has no coordinator or it
    restarts."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = head.job_status(job_id)
        if record is not None and check(record):
            return record
        assert record is None or record["state"] not in ("failed", "finished", "stopped"), record
        assert time.monotonic() < deadline, f"not {what} after {timeout_s:.0f} s: {record}"
        time.sleep(every_s)


def _driver_pid(job_id: str, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
                except OSError:
                    continue
                if b"elastic_zero.cli" in cmdline and b"run" in cmdline and job_id.encode() in cmdline:
                    return int(entry)
        time.sleep(0.2)
    raise AssertionError(f"no driver process of {job_id} in {timeout_s:.0f} s")


def _metric(head, name: str, job_id: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'job="{job_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def auth_head(request):
    failed = request.session.testsfailed  # a failed test's cluster keeps its Ray logs
    head = RayHead(auth=True, env={"RAY_metrics_report_interval_ms": "1000"})  # its metrics read within seconds
    yield head
    head.stop(keep_dir=request.session.testsfailed > failed)


@pytest.fixture(scope="module")
def open_head(request):
    failed = request.session.testsfailed
    head = RayHead(auth=False, env={"ELASTIC_ZERO_LINGER_S": "3"})  # a finished coordinator nobody collects from goes soon
    yield head
    head.stop(keep_dir=request.session.testsfailed > failed)


def test_job_on_a_token_auth_head(auth_head, workdir):
    head, cwd = auth_head, workdir
    (cwd / "job.toml").write_text(_spec(100000, str(cwd / "ckpt"), paced=True))
    (cwd / "bad.toml").write_text(_spec(100).replace("workers = 2", "workers = 9"))
    run_dir = str(cwd / "out")

    # a bad spec: exit 2 before anything reaches the cluster
    _one_line_error(_cli(head, cwd, "submit", "bad.toml", "--address", head.address), 2, "elastic.workers")
    # no token, a wrong token: one line saying what to set
    no_token = {k: v for k, v in head.client_env().items() if k != "RAY_AUTH_TOKEN_PATH"}
    r = subprocess.run([sys.executable, "-m", "elastic_zero.cli", "list", "--address", head.address], cwd=cwd,
                       env=no_token, capture_output=True, text=True, timeout=120)
    _one_line_error(r, 1, "requires a token", "RAY_AUTH_MODE=token")
    _one_line_error(_cli(head, cwd, "list", "--address", head.address, RAY_AUTH_TOKEN="0" * 32), 1,
                    "rejected the token")

    # submit: the token is found as Ray's CLI finds it (RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE unset)
    job_id = _ok(_cli(head, cwd, "submit", "job.toml", "--address", head.address, "--run-dir", run_dir)).strip()
    assert job_id.startswith("svc-")
    _one_line_error(_cli(head, cwd, "status", "nope", "--address", head.address), 1, "no job 'nope'")
    _until(head, cwd, job_id, "training", lambda r: r["state"] == "running" and r["step"] >= 3)

    # status over the dashboard's address: the documented schema, from the record the coordinator
    # publishes each second (read over HTTP), and as the coordinator answers now (--live: a control job)
    record = json.loads(_ok(_cli(head, cwd, "status", job_id, "--json", "--address", head.address)))
    assert list(record) == list(STATUS_KEYS) and record["schema"] == 7
    assert record["ray_job_status"] == "RUNNING" and record["world_size"] == 2 and record["name"] == "svc"
    assert [m["rank"] for m in record["members"]] == [0, 1] and all(m["node"] for m in record["members"])
    live = json.loads(_ok(_cli(head, cwd, "status", job_id, "--json", "--live", "--address", head.address)))
    assert list(live) == list(STATUS_KEYS) and live["coordinator"] == record["coordinator"]
    assert live["as_of"] >= record["as_of"] and live["step"] >= record["step"]
    assert "generation" in _ok(_cli(head, cwd, "status", job_id, "--address", head.address))

    # scale: outside [min, max] is refused in one line, by the client from the published record (no
    # control job submitted); 2 -> 3 by the CLI (one joiner proves it: CI's time), 3 -> 2 by the Python Client
    jobs_before = _ray_jobs(head)
    _one_line_error(_cli(head, cwd, "scale", job_id, "9", "--address", head.address), 1, "outside", "[1, 4]")
    assert _ray_jobs(head) == jobs_before, "a refused scale submitted a control job"
    _ok(_cli(head, cwd, "scale", job_id, "3", "--address", head.address))
    _until(head, cwd, job_id, "at 3 workers", lambda r: r["world_size"] == 3)
    client = (f"import json, elastic_zero as ez; c = ez.Client({head.address!r}); "
              f"print(json.dumps(c.published_status({job_id!r}))); print(c.scale({job_id!r}, 2))")
    published = json.loads(_ok(subprocess.run([sys.executable, "-c", client], cwd=cwd, env=head.client_env(),
                                              capture_output=True, text=True, timeout=240)).splitlines()[0])
    assert published is not None, "no record published"  # (status then asked through a control job)
    assert published["job_id"] == job_id and published["coordinator"] == record["coordinator"]
    record = _until(head, cwd, job_id, "back at 2 workers", lambda r: r["world_size"] == 2 and r["checkpoint"])
    sizes = [n for _, n in record["world_size_history"]]
    assert sizes[0] == 2 and sizes[-1] == 2 and 3 in sizes, sizes

    # Prometheus metrics through Ray's metrics agent
    deadline = time.monotonic() + 60
    while _metric(head, "ray_elastic_zero_world_size", job_id) != 2.0:
        assert time.monotonic() < deadline, "no elastic_zero metrics exported"
        time.sleep(1)
    assert _metric(head, "ray_elastic_zero_reconfigurations_total", job_id) >= 2

    # the coordinator and worker w1 are killed together: the job's driver starts the coordinator again,
    # and the new one takes w0 over and trains on from the step it stopped at, from memory (w1's shard
    # from w0's replica of it, no checkpoint read), then a replacement for w1 joins
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    (w1,) = [e["pid"] for e in events if e["event"] == "worker_ready" and e["actor_id"] == "w1"]
    os.kill(record["coordinator"]["pid"], signal.SIGKILL)
    os.kill(w1, signal.SIGKILL)
    resumed = _until(head, cwd, job_id, "taken over", lambda r: r["restarts"] == 1 and r["state"] == "running"
                     and r["step"] > record["step"] and r["generation"] is not None and r["world_size"] == 2)
    assert resumed["coordinator"]["pid"] != record["coordinator"]["pid"]
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    kinds = [e["event"] for e in events]
    assert "generation_taken_over" in kinds and "checkpoint_restored" not in kinds, kinds
    taken_over_t = events[kinds.index("generation_taken_over")]["t"]
    after = [e for e in events if e["event"] == "generation_start" and e["t"] > taken_over_t]
    assert after[0]["source"] == "snapshot" and after[0]["step"] > 0, after  # not started over
    deadline = time.monotonic() + 60
    while "took over generation" not in (logs := _ok(_cli(head, cwd, "logs", job_id, "--address", head.address))):
        assert time.monotonic() < deadline, logs[-2000:]
        time.sleep(2)
    assert "the coordinator was restarted (1); resuming from the workers' memory" in logs
    assert "restored" not in logs  # no checkpoint read

    # a graceful stop with a final checkpoint: exit 0, the Ray job SUCCEEDED
    assert "stop requested" in _ok(_cli(head, cwd, "stop", job_id, "--checkpoint", "--address", head.address))
    final = json.loads(_ok(_cli(head, cwd, "wait", job_id, "--json", "--address", head.address)))
    assert final["state"] == "stopped" and final["ray_job_status"] == "SUCCEEDED", final
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    assert summary["ok"] and summary["coordinator_restarts"] == 1
    # the whole job is counted, its first coordinator's steps too (their sample records are in its events)
    assert summary["duplicate_samples"] == 0 and summary["skipped_samples"] == 0
    assert summary["resumed_from_step"] == 0 and summary["steps"] == summary["stopped_at_step"]
    listed = _ok(_cli(head, cwd, "checkpoint", "ls", str(cwd / "ckpt")))
    assert f"step {summary['stopped_at_step']:>8}" in listed, listed
    assert any(r["job_id"] == job_id for r in json.loads(_ok(_cli(head, cwd, "list", "--json", "--address", head.address))))


def test_job_on_an_open_head_outlives_its_driver(open_head, workdir):
    head, cwd = open_head, workdir
    # paced (10 s at least): the driver is still there to be killed after the logs are read, on a loaded
    # machine, and the job leaves the CPU to the tests beside it
    steps = 50
    (cwd / "job.toml").write_text(_spec(steps, paced=True) + '[[faults]]\nat_step = 5\naction = "kill"\nrank = 1\n')
    run_dir = str(cwd / "out")
    submit = (f"import elastic_zero as ez; print(ez.Client({head.address!r}).submit(ez.spec.load_spec('job.toml'), "
              f"run_dir={run_dir!r}))")
    job_id = _ok(subprocess.run([sys.executable, "-c", submit], cwd=cwd, env=head.client_env(), capture_output=True,
                                text=True, timeout=240)).strip()
    driver = _driver_pid(job_id)
    _until(head, cwd, job_id, "recovered", lambda r: r["recoveries"] == 1 and r["step"] >= 8)
    # the driver's console: the kill is an event line, not Ray's error text
    logs = _ok(_cli(head, cwd, "logs", job_id, "--address", head.address))
    assert "worker w1 lost" in logs and "recovery: generation 1 goes on from step" in logs, logs[-2000:]
    assert "A worker died" not in logs
    assert os.path.exists(f"/proc/{driver}"), "the job ended before its driver could be killed"
    os.kill(driver, signal.SIGKILL)  # the detached coordinator goes on without it
    final = json.loads(_ok(_cli(head, cwd, "wait", job_id, "--json", "--address", head.address)))
    assert final["state"] == "finished" and final["step"] == steps, final
    assert final["ray_job_status"] == "FAILED"  # Ray saw its driver die; the training did not
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    assert summary["ok"] and summary["steps"] == steps and summary["duplicate_samples"] == 0
    assert summary["skipped_samples"] == 0
    # nobody collects its result: the coordinator goes by itself, and its last status stays
    deadline = time.monotonic() + 120  # it lingers 3 s (ELASTIC_ZERO_LINGER_S); Ray's kill can take long on a loaded machine
    while os.path.exists(f"/proc/{final['coordinator']['pid']}"):
        assert time.monotonic() < deadline, "the finished coordinator did not go"
        time.sleep(1)
    assert _status(head, cwd, job_id)["state"] == "finished"
    _one_line_error(_cli(head, cwd, "scale", job_id, "3", "--address", head.address), 1, job_id, "finished")
    assert "worker w1 lost" in _ok(_cli(head, cwd, "logs", job_id, "--follow", "--address", head.address))


def test_unreachable_cluster_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "elastic_zero.cli", "status", "x", "--address", "http://127.0.0.1:9"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "HOME": str(tmp_path)})
    _one_line_error(r, 1, "cannot reach the Ray dashboard at http://127.0.0.1:9")
