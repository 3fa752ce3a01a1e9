"""The chaos drill, short: seeded SIGKILLs (at steps, right after checkpoint steps, inside
handovers, before a new layout's first commit), scale-ups and -downs and preemption notices on
3-4 workers. Oracle: the same job without faults on one worker (weights within 1e-4), the sample
records (every sample exactly once), and every checkpoint left behind loading. The long drill
(300 steps, 5 seeds, stages 2 and 3) is `elastic-zero bench chaos`."""

import pytest

from elastic_zero.bench.chaos import run_chaos
from elastic_zero.bench.chaos_schedule import chaos_faults

pytestmark = [pytest.mark.runtime, pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def test_a_schedule_replays_from_its_seed_and_stays_in_bounds():
    faults = chaos_faults(7, 300, 20, 2, 4)
    assert faults == chaos_faults(7, 300, 20, 2, 4) and faults != chaos_faults(8, 300, 20, 2, 4)
    assert all(21 <= f["at_step"] < 297 for f in faults)
    assert all(f.get("rank", 0) < 2 and 2 <= f.get("workers", 2) <= 4 for f in faults)


def test_more_fault_kinds_are_asked_by_name_or_all_and_each_is_a_fault_the_spec_takes():
    from elastic_zero.bench.chaos import chaos_job
    from elastic_zero.bench.chaos_schedule import KINDS, MORE_KINDS, fault_kinds
    from elastic_zero.job.spec import spec_from_dict

    assert fault_kinds("all") == KINDS + MORE_KINDS and fault_kinds(" kill, hang ") == ("kill", "hang")
    for bad, named in (("kill,nope", "--faults: nope: not a fault kind"), (",", "--faults: none named")):
        with pytest.raises(ValueError, match=named):
            fault_kinds(bad)
    # the default kinds keep the schedules of the seeds run before (seed 7's, as drawn before --faults)
    faults = chaos_faults(7, 300, 20, 2, 4)
    assert len(faults) == 20 and [(f["at_step"], f["action"]) for f in faults[:10]] == [
        (21, "kill"), (52, "kill"), (68, "kill"), (85, "kill"), (93, "kill"), (107, "kill"), (116, "scale"),
        (133, "kill"), (151, "preempt"), (168, "scale")]
    data = chaos_job(3, 300, 2, "/tmp/ck", checkpoint_every=5, kinds=KINDS + MORE_KINDS)
    actions = {f["action"] for f in data["faults"]}
    assert set(MORE_KINDS) <= actions and all(f.get("rank", 0) < 2 for f in data["faults"]), actions
    spec = spec_from_dict(data)  # every action one the job's spec takes, with its rank
    assert len(spec.faults) == len(data["faults"])


@pytest.mark.parametrize("seed, stage", [(1, 3)])  # stage 2 (seed 2) passes too: `bench chaos` runs both
def test_chaos_ends_with_every_sample_once_and_the_fault_free_weights(tmp_path, seed, stage):
    report = run_chaos([seed], 100, [stage], str(tmp_path))
    (run,) = report["runs"]
    assert run["ok"], run["problems"]
    assert run["recoveries"] >= 2, "the schedule must lose workers, or the drill proves nothing"
    assert run["weights_diff"] <= 1e-4
    # a change that took in a worker ready only after it began names that worker's start (Ray's and its
    # own), whole, and how far into the change it was ready
    assert all(s > 0 for s in run["worker_starts_s"]) and all(s > 0 for s in run["workers_ready_after_s"])
    assert report["changes_with_a_worker_ready_after_them"] == len(run["worker_starts_s"])


def test_a_drill_with_standby_workers_keeps_its_faults_and_asks_for_them():
    """`--standby-workers N`: the same seeded faults, the job keeping N workers ready beside it; a
    count outside 0-4 is one line naming the option, before any Ray starts."""
    from elastic_zero.bench.chaos import chaos_job

    plain, standing = chaos_job(3, 300, 2, "/tmp/ck"), chaos_job(3, 300, 2, "/tmp/ck", standby_workers=1)
    assert standing["faults"] == plain["faults"] and standing["elastic"]["standby_workers"] == 1
    assert "standby_workers" not in plain["elastic"]
    for bad in (-1, 5, True, "1"):
        with pytest.raises(ValueError, match="--standby-workers: an integer from 0 to 4"):
            run_chaos([3], 300, [2], "/tmp/never-written", standby_workers=bad)
