"""`bench overhead`: the CPU accounting it rests on (process_cpu.py), against hand-made snapshots and
this process's own /proc, and its summary and report on made-up rounds. The bench end to end (a job
and the bare engine side by side) runs in the long tier."""

import os
import time

import pytest

from elastic_zero.bench.job_overhead import (ENGINE, JOB, JOB_NO_REPLICAS, WORKER_MARKER, _cpu, format_overhead,
                                             run_overhead_bench, summarize)
from elastic_zero.bench.process_cpu import Snapshot, cpu_shares, group_of, snapshot

pytestmark = pytest.mark.unit

COMMANDS = {
    10: "ray::TrainingWorker.train",
    11: "ray::TrainingWorker.train",
    12: "ray::Coordinator",
    13: "/venv/bin/python -I /src/elastic_zero/wire/heartbeats.py",
    14: "/venv/bin/python -I /src/elastic_zero/wire/beat_drain.py 40",
    15: "/venv/bin/python -I /src/elastic_zero/wire/rendezvous.py 39 12",
    16: "/home/u/elastic-zero/.venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
    17: "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x",
    18: "ray::DashboardAgent",
    19: "",  # a kernel thread
    20: "/usr/bin/sshd -D",
    21: "/home/ray/anaconda3/bin/python /home/ray/train.py",  # a user's process in Ray's image: not Ray's
    22: "/home/u/elastic-zero/.venv/bin/python /home/u/elastic-zero/.venv/bin/elastic-zero run job.toml",
    99: "/venv/bin/python -m pytest",  # the measuring process: the driver
}


def test_each_process_is_grouped_by_what_it_is_to_the_job():
    groups = {pid: group_of(command, pid, own_pid=99, worker_marker=WORKER_MARKER) for pid, command in COMMANDS.items()}
    assert groups[10] == groups[11] == ("workers", "worker")
    assert groups[12] == ("job's side", "coordinator")
    assert groups[13] == ("job's side", "beats")
    assert groups[14] == ("job's side", "beat drain")
    assert groups[15] == ("job's side", "relay")
    assert groups[99] == groups[22] == ("job's side", "driver")
    assert groups[16] == ("ray", "raylet") and groups[17] == ("ray", "gcs_server")
    assert groups[18][0] == "ray"
    assert groups[19] == ("other", "kernel") and groups[20] == ("other", "sshd") and groups[21] == ("other", "python")


def _snap(processes, idle=0, irq=0, total=0):
    return Snapshot(processes, idle_ticks=idle, irq_ticks=irq, total_ticks=total, cores=2)


def test_shares_are_of_one_core_over_the_window_and_count_a_process_born_or_ending_in_it():
    # two cores, a window of 100 ticks of one core (200 over both)
    gone = (20, 21, 22)
    before = _snap({pid: (1000, 7, c) for pid, c in COMMANDS.items() if pid not in gone}, 500, 40, 10_000)
    spent = {10: 80, 11: 70, 12: 3, 13: 1, 14: 1, 15: 1, 16: 2, 17: 1, 18: 1, 19: 0, 99: 1}
    after_processes = {pid: (1000 + spent[pid], 7, c) for pid, c in COMMANDS.items() if pid not in gone}
    after_processes[20] = (4, 9, COMMANDS[20])  # born within the window: all of its CPU is the window's
    after_processes[11] = (after_processes[11][0], 7, "")  # ending as the window closed: its command line gone
    after_processes[17] = (3, 9, COMMANDS[17])  # pid 17 ended and another took its number: all of the new one's
    after = _snap(after_processes, 535, 46, 10_200)
    shares = cpu_shares(before, after, WORKER_MARKER, own_pid=99)
    assert shares["workers"] == 150.0
    assert shares["job's side"] == 7.0  # coordinator 3, beats 1, drain 1, relay 1, driver 1
    assert shares["ray"] == 6.0  # raylet 2, the new gcs_server 3, the agent 1
    assert shares["other"] == 4.0
    assert shares["idle"] == 35.0 and shares["irq and steal"] == 6.0
    assert shares["by_name"]["job's side"]["coordinator"] == [3.0, 1]
    assert shares["by_name"]["workers"]["worker"] == [150.0, 2]
    assert cpu_shares(before, before, WORKER_MARKER, own_pid=99)["workers"] == 0.0  # no tick: no share


class _Snaps:
    def __init__(self, snaps):
        self.snaps = snaps


def test_the_cpu_a_step_counts_the_steps_that_ended_inside_the_window():
    first = _snap({10: (0, 1, WORKER_MARKER), 11: (0, 1, WORKER_MARKER)}, total=0)
    last = _snap({10: (400, 1, WORKER_MARKER), 11: (360, 1, WORKER_MARKER)}, total=1000)  # 5 s, 7.6 s of CPU
    window = _Snaps([(100.0, 3, first), (105.0, 12, last)])
    ends = [99.0, 100.0, 101.0, 102.5, 104.0, 105.0, 106.0]  # 4 in (100, 105]
    got = _cpu(window, WORKER_MARKER, workers=2, step_ends=ends)
    assert got["cpu"]["workers"] == 152.0 and got["window_s"] == 5.0
    assert got["cpu_s_per_step_per_worker"] == round(1.52 * 5.0 / 4 / 2, 4)
    assert _cpu(window, WORKER_MARKER, 2)["cpu_s_per_step_per_worker"] == round(1.52 * 5.0 / 9 / 2, 4)  # by marks
    assert _cpu(window, WORKER_MARKER, 2, step_ends=[99.0, 106.0])["cpu"] is None  # no step inside it
    assert _cpu(_Snaps([(100.0, 3, first), (101.0, 5, last)]), WORKER_MARKER, 2)["cpu"] is None  # under 2 s
    assert _cpu(_Snaps([(100.0, 3, first)]), WORKER_MARKER, 2)["cpu"] is None  # never closed


def test_a_snapshot_sees_this_process_spend_cpu():
    first = snapshot()
    until = time.process_time() + 0.3
    while time.process_time() < until:
        pass
    second = snapshot()
    pid = os.getpid()
    assert second.processes[pid][0] - first.processes[pid][0] >= 20  # 0.3 s of CPU: 30 ticks at 100 Hz, some slack
    assert second.total_ticks > first.total_ticks


def _round(times, workers=140.0, side=5.0, per_step=0.23, replicas=None):
    cpu = {"cores": 2, "workers": workers, "job's side": side, "ray": 3.0, "other": 1.0, "idle": 4.0, "irq and steal": 0.5,
           "by_name": {"job's side": {"coordinator": [side / 2, 1], "beats": [side / 2, 4]}}}
    return {"times": times, "cpu": cpu, "cpu_s_per_step_per_worker": per_step, "replicas": replicas}


def test_the_summary_sets_each_variant_against_the_engine_over_all_its_rounds():
    replicas = {"every": 2, "auto": True, "cost": 0.04, "reason": "every 2 step(s): a replica of 15.1 MiB ..."}
    runs = {ENGINE: [_round([0.40, 0.40]), _round([0.40, 0.50])],
            JOB: [_round([0.44, 0.44], side=6.0), _round([0.44, 0.60], side=4.0, replicas=replicas)],
            JOB_NO_REPLICAS: [_round([0.42, 0.42]), _round([0.42, 0.42])]}
    runs[JOB][0]["replicas"] = replicas
    report = summarize(runs, workers=4, preset="gpt-small", stage=2, micro_batch=4, warmup=5, steps=2, rounds=2)
    rows = report["rows"]
    assert rows[ENGINE]["median_step_s"] == 0.4 and rows[ENGINE]["vs_engine"] == 1.0
    assert rows[JOB]["median_step_s"] == 0.44 and rows[JOB]["vs_engine"] == 1.1
    assert rows[JOB_NO_REPLICAS]["vs_engine"] == 1.05
    assert rows[JOB]["vs_no_replicas"] == round(0.44 / 0.42, 4)
    assert rows[JOB]["cpu"]["job's side"] == 5.0  # the median over the rounds
    assert rows[JOB]["job_side_by_name"] == {"beats": 2.5, "coordinator": 2.5}
    text = format_overhead(report)
    assert "1.100x" in text and "coordinator 2.50%" in text and "every 2 step(s)" in text
    assert f"with its replicas: {0.44 / 0.42:.3f}x" in text


def test_bad_arguments_are_one_line_naming_them():
    with pytest.raises(ValueError, match="--steps >= 10"):
        run_overhead_bench(steps=3)


@pytest.mark.long
@pytest.mark.usefixtures("local_ray")
def test_the_bench_runs_the_engine_and_both_jobs_with_their_cpu(tmp_path):
    report = run_overhead_bench(workers=2, preset="gpt-small", micro_batch=4, warmup=2, steps=40, rounds=1,
                                work_root=str(tmp_path))
    for variant in (ENGINE, JOB, JOB_NO_REPLICAS):
        row = report["rows"][variant]
        assert 0 < row["median_step_s"] < 10
        assert row["cpu"]["workers"] > 50, row  # two workers training take most of the cores they have
        assert 0 < row["cpu_s_per_step_per_worker"] < 10
    assert report["rows"][JOB]["job_side_by_name"]["coordinator"] > 0
    assert report["rows"][JOB]["replicas"][0]["auto"] is True
