"""What `bench recovery` and `bench node-loss` measure in a run's summary: the recovery from their own
fault, the first, even where a loaded machine added another (a recovery whose generation was lost
whole is kept since the books' change, so two can follow one fault). Oracle: the summary itself."""

import pytest

from elastic_zero.bench.recovery import first_recovery, format_recovery

pytestmark = pytest.mark.unit

KILL = {"step": 10, "cause": "lost w1", "failed_at": 100.0, "to_next_step_done_s": 0.9, "lost_steps": 0,
        "recomputed_steps": 1}
LATER = {"step": 31, "cause": "lost w3", "failed_at": 140.0, "to_next_step_done_s": 2.5, "stall_s": None}


def test_the_first_recovery_is_the_benchs_own_in_any_order():
    assert first_recovery({"recoveries": [LATER, KILL]}, "/runs/x") is KILL
    assert first_recovery({"recoveries": [KILL]}, "/runs/x") is KILL


def test_a_run_without_a_recovery_is_one_line_naming_its_directory():
    with pytest.raises(RuntimeError, match=r"^the elastic_zero run recorded no recovery; see /runs/x$"):
        first_recovery({"recoveries": []}, "/runs/x")


def test_a_recovery_that_trained_no_step_before_the_end_is_one_line_not_a_type_error():
    ended = {**KILL, "to_next_step_done_s": None, "stall_s": 0.4}  # lost in the final save
    with pytest.raises(RuntimeError, match=r"^the elastic_zero run's recovery at step 10 completed no step after it "
                                           r"\(the job ended first: give the bench more steps\); see /runs/x$"):
        first_recovery({"recoveries": [ended]}, "/runs/x")


def test_the_report_says_when_the_run_recovered_more_than_once():
    report = {"preset": "gpt-tiny", "workers": 3, "kill_step": 10, "against": "ray-train", "elastic_zero_recovery_s": 0.9,
              "elastic_zero_recomputed_steps": 1, "elastic_zero_lost_steps": 0, "ray_train_recovery_s": 9.0,
              "ray_train_recomputed_steps": 4, "checkpoint_every": 5, "ratio": 0.1, "scale_up_stall_s": 0.2,
              "elastic_zero_recoveries": 1}
    assert "recovered" not in format_recovery(report) and "scale-up stall 0.20 s" in format_recovery(report)
    assert "scale-up stall -" in format_recovery({**report, "scale_up_stall_s": None})  # the replacement came too late
    assert "the run recovered 2 times, the first is the kill's" in format_recovery({**report, "elastic_zero_recoveries": 2})


def test_steps_trained_again_are_those_past_where_the_next_generation_started():
    from elastic_zero.bench.coordinator_loss import retrained_steps

    taken_over = [{"event": "generation_start", "generation": 0, "step": 0},
                  {"event": "generation_end", "generation": 0, "steps_done": 16},
                  {"event": "generation_start", "generation": 1, "step": 16},  # live shards: none again
                  {"event": "generation_end", "generation": 1, "steps_done": 40}]
    assert retrained_steps(taken_over) == 0
    replicas = taken_over[:2] + [{"event": "generation_start", "generation": 1, "step": 14},
                                 {"event": "generation_end", "generation": 1, "steps_done": 30},
                                 {"event": "generation_start", "generation": 2, "step": -1}]  # a checkpoint's
    assert retrained_steps(replicas) == 2
