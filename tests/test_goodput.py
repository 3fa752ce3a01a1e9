"""The goodput benchmark's pure parts (bench/goodput_schedule.py): the schedule and the accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.bench.goodput_schedule import (
    ACTIONS, AUTOSCALED_ACTIONS, START_NODES, autoscaled_schedule, goodput, goodput_schedule, kept_steps,
)

pytestmark = pytest.mark.unit


@settings(max_examples=200, deadline=None)
@given(window=st.floats(400, 3600), seed=st.integers(0, 10**6), notice=st.floats(1, 35))
def test_the_schedule_is_ordered_and_each_node_is_used_as_it_exists(window, seed, notice):
    schedule = goodput_schedule(window, seed, notice)
    assert [e.action for e in schedule] == ["node_lost", "node_back", "notice", "preempted", "scale_up", "end"]
    assert all(a.at_s < b.at_s for a, b in zip(schedule, schedule[1:])), schedule
    assert schedule[-1].at_s == window and set(e.action for e in schedule) <= set(ACTIONS)
    alive = set(START_NODES)
    for event in schedule:  # a node is told, lost or replaced only while it is there
        if event.node is not None and event.action != "scale_up":
            assert event.node in alive, event
        if event.action in ("node_back", "preempted"):
            alive.discard(event.node)
        alive.update(n for n in (event.replaced_by, event.node if event.action == "scale_up" else None) if n)
    notice = next(e for e in schedule if e.action == "notice")
    preempted = next(e for e in schedule if e.action == "preempted")
    assert preempted.at_s == pytest.approx(notice.at_s + notice.deadline_s, abs=0.1)


@settings(max_examples=200, deadline=None)
@given(window=st.floats(200, 3600), seed=st.integers(0, 10**6), notice=st.floats(1, 35))
def test_the_autoscaled_schedule_reclaims_one_node_then_notices_another_and_reclaims_it_at_its_deadline(
        window, seed, notice):
    schedule = autoscaled_schedule(window, seed, notice)
    assert [(e.action, e.node) for e in schedule] == [("reclaim", "first"), ("notice", "second"),
                                                      ("reclaim", "second"), ("end", None)]
    assert all(a.at_s < b.at_s for a, b in zip(schedule, schedule[1:])), schedule
    assert schedule[-1].at_s == window and {e.action for e in schedule} <= set(AUTOSCALED_ACTIONS)
    assert schedule[2].at_s == pytest.approx(schedule[1].at_s + notice, abs=0.1)
    assert autoscaled_schedule(window, seed, notice) == schedule


def test_an_autoscaled_window_too_short_for_its_notice_or_torchft_on_it_is_one_line():
    from elastic_zero.bench.goodput import run_goodput_bench

    with pytest.raises(ValueError, match="window_s 100 is too short for a 30 s notice: need window_s > 150"):
        autoscaled_schedule(100, 0, 30)
    with pytest.raises(ValueError, match="--autoscaler plays to elastic_zero and ray_train"):
        run_goodput_bench(systems=("elastic_zero", "torchft"), autoscaler=True)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert goodput_schedule(600, 3) == goodput_schedule(600, 3)
    assert goodput_schedule(600, 3) != goodput_schedule(600, 4)


@pytest.mark.parametrize("window, notice, message", [
    (200, 30, "window_s 200 is too short for a 30 s notice: need window_s > 333"),
    (600, 0.5, "notice_s must be >= 1, got 0.5"),
    (600, float("nan"), "notice_s must be >= 1, got nan"),
    (float("nan"), 30, "window_s must be > 0, got nan"),
])
def test_a_window_too_short_for_its_notice_is_refused_by_name(window, notice, message):
    with pytest.raises(ValueError, match=message):
        goodput_schedule(window, 0, notice)


def test_a_step_recomputed_after_a_restart_counts_once_in_its_last_run():
    """Steps 0-5 in a first attempt, a restart from the checkpoint at 3: steps 3-5 run again;
    the kept runs are the later ones, three runs were thrown away."""
    first = [{"step": s, "started": s, "done": s + 0.5, "attempt": "x"} for s in range(6)]
    second = [{"step": s, "started": 10 + s, "done": 10 + s + 0.8, "attempt": "y"} for s in range(3, 8)]
    kept, redone = kept_steps(second + first)  # in any order
    assert redone == 3 and sorted(kept) == list(range(8))
    assert [kept[s]["attempt"] for s in range(8)] == ["x"] * 3 + ["y"] * 5
    assert goodput([r["done"] - r["started"] for r in kept.values()], wall_s=10.0) == pytest.approx(0.55)


def test_goodput_needs_a_positive_wall_time():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        goodput([1.0], 0)


def test_the_startup_phases_add_up_from_the_runs_records():
    """bench startup's split of the time to the first step (bench/startup.py), from a run's events."""
    from elastic_zero.bench.startup import PHASES, startup_phases

    events = [{"event": "job_start", "t": 102.0}, {"event": "spawn", "t": 102.1},
              {"event": "worker_ready", "t": 104.0}, {"event": "worker_ready", "t": 104.5},
              {"event": "generation_start", "t": 104.6}, {"event": "worker_ready", "t": 200.0}]
    summary = {"started_at_epoch": 100.0, "time_to_first_step_s": 5.0, "step_time_curve": [[0, 0.8], [1, 0.5]]}
    phases = startup_phases(100.0, 101.0, events, summary)
    assert phases == {"ray_init": 1.0, "coordinator": 1.0, "to_spawn": 0.1, "workers_ready": 2.4,
                      "to_generation": 0.1, "generation": 0.4, "first_step": 0.8, "total_to_first_step_done": 5.8}
    assert sum(phases[p] for p in PHASES) == pytest.approx(phases["total_to_first_step_done"])  # nothing left out


def _ray_train_records():
    """Attempt x trains steps 0-5, is lost; attempt y restarts from the checkpoint at 4 with 2 workers."""
    first = [{"step": s, "started": 10 + s, "done": 10.5 + s, "world": 4, "attempt": "x"} for s in range(6)]
    second = [{"step": s, "started": 30 + s, "done": 30.75 + s, "world": 2, "attempt": "y"} for s in range(4, 8)]
    return first + second


def test_ray_train_figures_count_the_kept_runs_the_redone_steps_and_the_restarts():
    from elastic_zero.bench.goodput_schedule import ray_train_figures

    f = ray_train_figures(_ray_train_records(), global_batch=16, launched_at=0.0, wall_s=40.0)
    assert (f["steps_kept"], f["steps_redone"], f["restarts"]) == (8, 2, 1)
    assert f["productive_s"] == 4 * 0.5 + 4 * 0.75 and f["goodput"] == round(5.0 / 40, 3)
    assert (f["samples_trained"], f["samples_kept"]) == (10 * 16, 8 * 16) and f["useful_samples_per_s"] == 3.2
    assert f["first_step_done_s"] == 10.5 and f["world_sizes"] == [[0, 4], [4, 2]]
    assert f["step_s_median"] == 0.625  # the kept runs: four of 0.5 s (attempt x), four of 0.75 s (y)
    # steps 0-3 of attempt x end a second apart at 4 workers; 4-7 of y too, at 2 (3 -> 4 is the restart's)
    assert f["steady"] == {4: {"gaps": 3, "step_s": 1.0, "samples_per_s": 16.0},
                           2: {"gaps": 3, "step_s": 1.0, "samples_per_s": 16.0}}


def test_elastic_zero_figures_leave_the_commit_and_checkpoint_time_out_of_the_steps():
    from elastic_zero.bench.goodput_schedule import elastic_zero_figures

    summary = {"step_time_curve": [[0, 1.0], [1, 0.6], [2, 0.6]], "protect_time_curve": [[0, 0.1], [1, 0.1], [2, 0.3]],
               "recoveries": [{"lost_steps": 0}], "reconfigurations": [{}, {}], "samples_consumed": 48,
               "duplicate_samples": 0, "skipped_samples": 0, "world_size_history": [[0, 4], [1, 2]]}
    events = [{"event": "job_start", "t": 101.0}, {"event": "decision", "on": "GenerationStepped", "t": 106.0},
              {"event": "decision", "on": "GenerationStepped", "t": 108.0}]
    f = elastic_zero_figures(summary, events, launched_at=100.0, wall_s=10.0)
    assert f["productive_s"] == 1.7 and f["goodput"] == 0.17 and f["steps_kept"] == 3
    assert (f["steps_redone"], f["recoveries"], f["reconfigurations"], f["restarts"]) == (0, 1, 2, 0)
    assert f["first_step_done_s"] == 6.0 and f["useful_samples_per_s"] == 4.8
    assert f["step_s_median"] == 0.6  # the whole step, its commit included
    # a coordinator that ended without a summary: no figures, no crash
    assert elastic_zero_figures({}, [], 100.0, 10.0)["steps_kept"] == 0


def test_the_steady_rate_of_a_size_is_its_steps_median_gap_and_leaves_out_the_events():
    from elastic_zero.bench.goodput_schedule import elastic_zero_figures, steady_rates

    # 4 workers a step each 0.5 s; a recovery (step 3 ends 5 s after step 2); 2 workers a step each
    # 0.4 s; no end known for step 7, so the gap 6 -> 8 is no one step's; the last gap is slow (the median holds)
    ends = [[0, 10.0], [1, 10.5], [2, 11.0], [3, 16.0], [4, 16.4], [5, 16.8], [6, 17.2], [8, 20.0], [9, 20.4],
            [10, 21.4]]
    summary = {"step_end_curve": ends, "world_size_history": [[0, 4], [3, 2]], "global_batch": 16}
    rates = elastic_zero_figures(summary, [], 0.0, 30.0)["steady"]
    assert rates == {4: {"gaps": 2, "step_s": 0.5, "samples_per_s": 32.0},
                     2: {"gaps": 5, "step_s": 0.4, "samples_per_s": 40.0}}
    assert list(rates) == [4, 2]  # the largest size first
    # the order given does not matter: a step's end orders it; no two steps at one size: nothing
    assert steady_rates([(1, 2.0, 4, 16), (0, 1.0, 4, 16)]) == {4: {"gaps": 1, "step_s": 1.0, "samples_per_s": 16.0}}
    assert steady_rates([(0, 1.0, 4, 16), (1, 2.0, 2, 16)]) == {} and steady_rates([]) == {}
    assert steady_rates([(0, 1.0, None, 16), (1, 2.0, None, 16)]) == {}  # no size known for them


def test_the_report_prints_both_systems_side_by_side_and_a_failure_by_its_reason():
    from elastic_zero.bench.goodput import format_goodput
    from elastic_zero.bench.goodput_schedule import ray_train_figures

    report = {"preset": "gpt-small", "window_s": 600.0, "seed": 0, "checkpoint_every": 20,
              "schedule": [{"at_s": 600.0, "action": "end", "node": None}],
              "elastic_zero": {"rc": 1, "error": "no summary; see /tmp/x", "wall_s": 5.0, "played": []},
              "ray_train": {"rc": 0, "error": None, "wall_s": 40.0,
                            **ray_train_figures(_ray_train_records(), 16, 0.0, 40.0)}}
    lines = format_goodput(report).splitlines()
    assert lines[1] == "  schedule: 600 s end"
    assert lines[3] == "  elastic_zero   failed: no summary; see /tmp/x"
    assert lines[4].split() == ["ray_train", "0.125", "40.0", "5.0", "8", "2", "1", "160", "128", "3.2", "10.5", "0.625"]
    assert lines[6].strip() == ("steady state by world size: 4: 16.0 samples/s, a step every 1.000 s; "
                                "2: 16.0 samples/s, a step every 1.000 s")


def _torchft_record(group, step, started, done, committed=True, participating=True, participants=2, samples=4):
    return {"group": group, "step": step, "started": started, "done": done, "committed": committed,
            "participants": participants, "participating": participating, "samples": samples, "attempt": f"g{group}"}


def test_torchft_figures_keep_each_step_once_with_the_shares_of_the_groups_that_took_part():
    from elastic_zero.bench.goodput_schedule import torchft_figures

    records = [
        # steps 0-1: two groups (slots of a 4-share batch) train together
        _torchft_record(0, 0, 10.0, 10.5), _torchft_record(1, 0, 10.1, 10.5),
        _torchft_record(1, 1, 10.5, 11.0), _torchft_record(0, 1, 10.5, 11.0),
        # step 2: the all-reduce fails (a peer froze): nobody commits, the step is run again
        _torchft_record(0, 2, 11.0, 16.0, committed=False), _torchft_record(1, 2, 11.0, 16.0, committed=False),
        # step 2 again, group 1 alone; group 2 heals into it (its gradients count zero)
        _torchft_record(1, 2, 16.0, 17.0, participants=1),
        _torchft_record(2, 2, 12.0, 17.0, participating=False, participants=1),
        # step 3: groups 1 and 2
        _torchft_record(1, 3, 17.0, 17.5), _torchft_record(2, 3, 17.0, 17.5),
    ]
    f = torchft_figures(records, global_batch=16, launched_at=0.0, wall_s=20.0, restarts=1)
    assert f["steps_kept"] == 4 and f["steps_redone"] == 1 and f["restarts"] == 1
    # each kept step's time is its lowest participating group's: 0.5 + 0.5 + 1.0 (group 1 alone) + 0.5
    assert f["productive_s"] == 2.5 and f["goodput"] == 0.125 and f["step_s_median"] == 0.5
    # shares kept: 2 + 2 + 1 + 2 groups of 4 samples; every record trained its share, kept or not
    assert f["samples_kept"] == 28 and f["samples_trained"] == 40 and f["skipped_samples"] == 4 * 16 - 28
    assert f["useful_samples_per_s"] == 1.4 and f["first_step_done_s"] == 10.5
    assert f["world_sizes"] == [[0, 2], [2, 1], [3, 2]]
    # two groups: steps 0 -> 1 a gap of 0.5 s keeping 8 samples (2 -> 3 spans the change of size)
    assert f["steady"] == {2: {"gaps": 1, "step_s": 0.5, "samples_per_s": 16.0}}
    assert torchft_figures([], 16, 0.0, 20.0, restarts=0)["steps_kept"] == 0


def test_torchft_figures_keep_the_last_timeline_when_every_group_began_again():
    from elastic_zero.bench.goodput_schedule import torchft_figures

    first = [_torchft_record(g, s, 10.0 + s, 10.5 + s) for s in range(5) for g in (0, 1)]
    # every group failed after step 4 (the stock DDP hook); restarted groups found no peer and began at 0
    again = [_torchft_record(g, s, 30.0 + s, 30.5 + s) for s in range(3) for g in (2, 3)]
    f = torchft_figures(first + again, global_batch=16, launched_at=0.0, wall_s=40.0, restarts=2)
    # the final model is the second timeline's: its 3 steps are kept, the first one's 5 were thrown away
    assert f["steps_kept"] == 3 and f["steps_redone"] == 5
    assert f["samples_kept"] == 3 * 2 * 4 and f["skipped_samples"] == 3 * 16 - 24
    assert f["world_sizes"] == [[0, 2]] and f["productive_s"] == 1.5 and f["first_step_done_s"] == 10.5


@pytest.mark.parametrize("systems, against, expected", [
    (None, None, ("elastic_zero", "ray_train")),
    (None, "torchft", ("elastic_zero", "torchft")),
    (None, "ray-train", ("elastic_zero", "ray_train")),
    ("elastic_zero, torchft,torchft", None, ("elastic_zero", "torchft")),
])
def test_the_command_line_names_the_systems_by_list_or_by_peer(systems, against, expected):
    from elastic_zero.bench.goodput import goodput_systems

    assert goodput_systems(systems, against) == expected


@pytest.mark.parametrize("systems, against, message", [
    ("elastic_zero", "torchft", "give --systems or --against, not both"),
    (None, "nope", "--against: got 'nope'; allowed: ray-train, torchft"),
])
def test_a_wrong_choice_of_peer_is_one_line(systems, against, message):
    from elastic_zero.bench.goodput import goodput_systems

    with pytest.raises(ValueError, match=message):
        goodput_systems(systems, against)


def test_a_missing_torchft_is_named_with_its_extra_before_anything_starts(monkeypatch):
    from elastic_zero.bench import goodput, torchft_cluster

    monkeypatch.setattr(torchft_cluster, "torchft_installed", lambda: False)
    with pytest.raises(ValueError, match=r"bench goodput: torchft is not installed: pip install -e '\.\[anchors\]'"):
        goodput.run_goodput_bench(systems=("elastic_zero", "torchft"))


@pytest.mark.parametrize("name", ["missing.py", "paced.txt"])
def test_a_loss_file_that_is_no_python_file_is_refused_before_anything_starts(tmp_path, name):
    from elastic_zero.bench.goodput import run_goodput_bench

    (tmp_path / "paced.txt").write_text("def loss(model, batch): ...\n")
    with pytest.raises(ValueError, match=f"loss_file must be an existing .py file, got '.*{name}'"):
        run_goodput_bench(systems=("elastic_zero",), loss_file=str(tmp_path / name))
