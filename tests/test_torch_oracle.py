"""The runtime tests' oracle (torch_oracle.py) carried on to a later step is the run made afresh to
it, and asked for an earlier step it starts over: the same weights either way."""

import pytest
import torch

from runtime_jobs import job_spec
from torch_oracle import AdamWTrajectory

pytestmark = pytest.mark.unit


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _trajectory(global_batch: int = 8) -> AdamWTrajectory:
    return AdamWTrajectory(job_spec("oracle", train={"global_batch": global_batch}))


def test_a_trajectory_carried_on_or_started_over_gives_the_weights_of_a_fresh_one():
    carried = _trajectory()
    at_2, at_5 = carried.weights_at(2), carried.weights_at(5)
    assert _same(at_5, _trajectory().weights_at(5))
    assert _same(carried.weights_at(2), at_2) and carried.step == 2  # started over
    assert not _same(at_2, at_5) and not _same(at_5, _trajectory(global_batch=9).weights_at(5))


def test_what_the_oracle_does_not_run_is_refused():
    with pytest.raises(ValueError, match="AdamW at a constant rate, not sgd"):
        AdamWTrajectory(job_spec("oracle", optimizer={"name": "sgd"}))
