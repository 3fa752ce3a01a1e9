"""Which fault drill is due when: pure, no Ray."""

from elastic_zero.job.spec import FaultSpec
from elastic_zero.worker.drills import due_drills

FAULTS = (
    FaultSpec(at_step=5, action="kill", rank=1),
    FaultSpec(at_step=5, action="scale", workers=3),  # no rank: rank 0 carries it out
    FaultSpec(at_step=7, action="kill_in_handover", rank=1),
    FaultSpec(at_step=7, action="kill_after_handover", rank=0),
)


def _due(moment, rank, step, plan_step=0, source="init"):
    return [i for i, _ in due_drills(FAULTS, moment, rank, step, plan_step, source)]


def test_step_drills_fire_at_their_step_on_their_rank():
    # a kill inside its step, once the step's replicas are committed; the others before the step
    assert _due("commit", 1, 5) == [0] and _due("step", 0, 5) == [1]
    assert _due("step", 1, 5) == [] and _due("commit", 0, 5) == []
    assert _due("commit", 1, 4) == [] and _due("commit", 2, 5) == [] and _due("step", 1, 4) == []


def test_handover_drills_fire_in_the_first_handover_from_their_step_on():
    assert _due("handover", 1, 9, plan_step=9, source="live") == [2]
    assert _due("handover", 1, 9, plan_step=9, source="snapshot") == [2]
    assert _due("handover", 1, 6, plan_step=6, source="live") == []  # before at_step
    assert _due("handover", None, 9, plan_step=9, source="live") == []  # a leaver has no new rank
    assert _due("first_step", 0, 8, plan_step=8, source="live") == [3]
    assert _due("first_step", 0, 8, plan_step=8, source="checkpoint") == []  # not a handover
    assert _due("step", 1, 7) == [] and _due("step", 0, 7) == []  # never at an ordinary step
