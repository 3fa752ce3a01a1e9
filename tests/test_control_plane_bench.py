"""`bench control-plane` at 64 simulated workers: the real coordinator carries every scenario (a
silent node, 64 joiners, 8 nodes preempted at once, a stop). Timings are the bench's; this checks
what happened."""

import json
import os
import subprocess
import sys

import pytest

from elastic_zero.bench.control_plane_figures import busiest_nodes, growth, problems

CLI = [sys.executable, "-m", "elastic_zero.cli"]


@pytest.mark.runtime
def test_the_coordinator_carries_64_simulated_workers_through_every_scenario(tmp_path):
    # a temp dir of its own, where the bench's work dir must not stay once it ended well (Ray's kept in
    # /tmp: its socket paths have a length limit)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(CLI + ["bench", "control-plane", "--workers", "64", "--steady", "3", "--real", "", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(scratch), "RAY_TMPDIR": "/tmp"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name for p in scratch.iterdir() if p.name.startswith("ez-control-plane-")] == []
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["rows"]  # Ray may print warnings first
    assert "error" not in row, row
    # the silent node was found by its heartbeats, and its 8 workers' shards restored from their buddies
    assert row["detect_s"] is not None and row["survivors_hold_plan_s"] is not None
    # the 64 joiners held their plans; the 8 preempted nodes' 64 workers handed over and left
    assert row["joiners_admitted_s"] is not None and row["handoff_leavers"] == 64
    assert row["stopped_ok"] and row["rendezvous_s"] is not None and row["status_s"] is not None
    # generations: start, recovery, the replacements' join, the scale-up, the hand-off (the stop ends the last)
    assert row["generations"] >= 5
    # a safe point is asked of one member (the step's all-reduce tells the others), not of all 64-128
    assert 1 <= row["safe_point_requests"] < row["generations"]
    # a worker's train call stands from generation to generation: one call for each worker spawned (at
    # the start, replacements, joiners), not one per worker per generation
    assert row["train_calls"] <= row["workers_spawned"] and row["plans_trained"] > 2 * row["train_calls"], row
    # where the CPU went: the relay (a process of the coordinator's own; at 64 it may spend less than
    # a 10 ms clock tick in a recovery) and the simulated workers worked
    for window in (row["recovery_window"], row["scale_up_window"]):
        assert window["wall_s"] > 0 and window["relay_processes"] == 1 and window["relay_cpu_s"] >= 0, window
        assert window["listener_processes"] == 1 and window["listener_cpu_s"] >= 0, window  # wire/beat_drain.py
        assert window["simulated_workers_cpu_s"] > 0, window
    # what beats were lost and where: at least the frozen node's 8 to silence; the machine's drop
    # counters read around the run (this machine's, every process's: not negative, that is all)
    assert row["lost_to_silence"] >= 8 and row["silence_decisions"] >= 1
    assert isinstance(row["sim_beats_refused"], int) and all(v >= 0 for v in row["kernel_drops"].values())
    # whether a silence was the harness's: its beats' longest gap; the drain's niceness (beat_drain.run_ahead)
    assert row["sim_longest_beat_gap_s"] > 0 and isinstance(row["listener_nice"], int)
    # the headline is the coordinator's own CPU in each window, the harness's beside it
    assert row["recovery_coordinator_cpu_s"] == row["recovery_window"]["coordinator_cpu_s"]
    assert row["steady_control_cpu"] == pytest.approx(row["steady_cpu"] + row["steady_listener_cpu"], abs=2e-4)
    assert row["joiners_coordinator_cpu_s"] == row["scale_up_window"]["coordinator_cpu_s"]
    from elastic_zero.bench.control_plane_report import format_control_plane

    table = format_control_plane(json.loads(done.stdout.strip().splitlines()[-1])).splitlines()
    assert "loss: coord s" in table[1] and "(harness s)" in table[1]
    cells = table[2].split()
    assert cells[0] == "64" and cells[4] == f"{row['recovery_coordinator_cpu_s']:g}"
    assert cells[5] == f"{row['recovery_window']['simulated_workers_cpu_s']:g}"
    assert any(line.startswith("  goal at 64: recovery_coordinator_cpu_s") for line in table)
    beats = [line for line in table if line.startswith(f"  beats at 64: {row['lost_to_silence']} workers lost to silence")]
    assert len(beats) == 1 and f"the simulated beats' longest gap {row['sim_longest_beat_gap_s']:g} s" in beats[0]


def test_bad_arguments_are_one_line_each_before_anything_starts(tmp_path):
    for args, message in ((["--workers", "0"], "--workers: must be at least 1, got 0"),
                          (["--workers", "64", "--per-node", "7"], "--per-node: 7 does not divide --workers 64"),
                          (["--workers", "8"], "the scenario needs 2"),
                          (["--workers", "many"], "--workers: comma-separated whole numbers, got 'many'"),
                          (["--workers", "1000000"], "GiB available")):
        done = subprocess.run(CLI + ["bench", "control-plane", *args], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_the_figures_rules():
    assert problems(64, 8, 64 << 30) == []
    assert problems(1024, 8, 1 << 30)[0].startswith("--workers: 1024 simulated workers (and 64 joiners) need about")
    events = [{"event": "worker_ready", "actor_id": f"w{i}", "node": f"n{i % 3}"} for i in range(9)]
    assert busiest_nodes(events, [f"w{i}" for i in range(8)], 2, skip="n0") == ["n1", "n2"]
    assert growth([16, 1024], [1.0, 64.0]) == 1.0 and growth([16, 1024], [1.0, 8.0]) == 0.125
