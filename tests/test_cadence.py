"""replicate_every = "auto": the pure chooser (plan/cadence.py) and a worker's meter of it
(worker/cadence_meter.py). Oracle: the definition, the smallest cadence whose commit fits the budget
of the steps it spans, checked against every smaller one."""

import math

import pytest
from hypothesis import given, strategies as st

from elastic_zero.plan.cadence import REPLICA_BUDGET, CommitCost, agreed_every, choose_cadence
from elastic_zero.worker.cadence_meter import DECIDE_AT, CadenceMeter

pytestmark = pytest.mark.unit

times = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@given(copy_s=times, swap_s=times, step_s=st.floats(min_value=1e-4, max_value=10.0),
       most=st.integers(min_value=1, max_value=5000))
def test_the_cadence_is_the_most_frequent_whose_copies_fit_the_budget(copy_s, swap_s, step_s, most):
    cadence = choose_cadence(CommitCost(2**20, copy_s, swap_s, step_s), most=most)
    commit_s = max(copy_s, swap_s)

    def fits(every):
        return commit_s <= REPLICA_BUDGET * every * step_s * (1 + 1e-9)

    assert 1 <= cadence.every <= most
    assert fits(cadence.every) or cadence.every == most
    assert cadence.every == 1 or not fits(cadence.every - 1)
    assert cadence.cost == pytest.approx(commit_s / (cadence.every * step_s))
    assert f"every {cadence.every} step(s)" in cadence.reason


def test_the_cadence_of_a_slow_link_and_of_no_step_yet():
    # a 1 GiB shard at 1 GB/s off the device and 0.5 GB/s over the link, 0.2 s steps: 2.15 s a commit,
    # 5% of a step is 10 ms: every 215 steps
    gib = 2**30
    cadence = choose_cadence(CommitCost(gib, gib / 1e9, gib / 0.5e9, 0.2))
    assert cadence.every == math.ceil((gib / 0.5e9) / (0.05 * 0.2)) == 215 and cadence.cost <= 0.05
    assert "1024.0 MiB" in cadence.reason and "2147.5 ms over the link" in cadence.reason
    assert choose_cadence(CommitCost(gib, 5.0, 5.0, 0.0)).every == 1  # nothing to weigh it against yet
    assert "longest cadence" in choose_cadence(CommitCost(gib, 100.0, 1.0, 0.01), most=10).reason
    with pytest.raises(ValueError, match="CommitCost.step_s must be a time >= 0"):
        CommitCost(1, 0.0, 0.0, -1.0)


@given(st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=64))
def test_the_ranks_take_the_largest_cadence_proposed(proposals):
    """The steps go in lockstep: the slowest pair's copies stall every rank, so its cadence is the job's."""
    assert agreed_every(float(max(proposals))) == max(proposals)
    assert agreed_every(0.0) == 1


def test_a_meter_proposes_at_its_deciding_step_only_and_takes_the_agreed_cadence():
    meter = CadenceMeter("auto")
    meter.new_generation()
    assert meter.every == 1 and meter.proposal() == 1.0  # nothing measured yet
    assert [meter.deciding(n) for n in range(6)] == [False, False, False, True, False, False] and DECIDE_AT == 4
    meter.step_done(3.0)  # the generation's first step: one-off costs, left out
    meter.step_done(0.100)
    meter.step_done(0.100)
    meter.commit_done(2**20, 0.002, 0.012)  # 12 ms a commit, 5 ms of budget a step: every 3
    assert meter.measured().step_s == pytest.approx(0.1) and meter.proposal() == 3.0
    chosen = meter.agree(5.0)  # another rank measured a slower link: its cadence is the job's
    assert meter.every == 5 and chosen.every == 5 and chosen.cost == pytest.approx(0.012 / 0.5)
    assert "the slowest rank's proposal" in chosen.reason
    assert meter.summary() == {"every": 5, "auto": True, "cost": 0.024, "reason": chosen.reason}
    meter.new_generation()  # a new world size: measured anew, every step until then
    assert meter.every == 1 and meter.summary()["cost"] is None
    fixed = CadenceMeter(5)
    fixed.new_generation()
    assert fixed.every == 5 and not fixed.deciding(DECIDE_AT - 1) and not fixed.summary()["auto"]


def test_a_spec_takes_auto_or_a_count_and_names_the_field_otherwise():
    from elastic_zero.job.spec import SpecError, spec_from_dict

    assert spec_from_dict({}).elastic.replicate_every == "auto"
    assert spec_from_dict({"elastic": {"replicate_every": 0}}).elastic.replicate_every == 0
    for bad, why in (("often", "must be an integer >= 0 or \"auto\", got 'often'"), (-2, "got -2"),
                     (True, "must be an integer or a string, got True"), (2.5, "got 2.5")):
        with pytest.raises(SpecError, match=r"elastic\.replicate_every: .*" + why.replace("(", r"\(")):
            spec_from_dict({"elastic": {"replicate_every": bad}})


def test_a_commit_is_timed_as_its_copy_off_the_device_and_its_swap_over_the_link():
    from elastic_zero.worker.replication import InFlight

    cpu = InFlight(3, None, [], None, copy_s=0.02, started_at=10.0, copied_at=10.0, arrived_at=10.5)
    assert cpu.times() == pytest.approx((0.02, 0.5))
    # a side stream's copy ran on after the step handed it over: the exchange waited 0.1 s for it
    gpu = InFlight(3, None, [], object(), copy_s=0.001, started_at=10.0, copied_at=10.1, arrived_at=10.3)
    assert gpu.times() == pytest.approx((0.101, 0.2))
    failed = InFlight(3, None, [], None, started_at=10.0)  # never arrived: nothing measured past its start
    assert failed.times() == (0.0, 0.0)
