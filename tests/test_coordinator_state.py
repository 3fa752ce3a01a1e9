"""The coordinator's state machine, driven by events alone: no Ray, no clock."""

from dataclasses import replace

from elastic_zero.coordinator.state import (
    CheckpointCommitted, CheckpointNow, CoordinatorState, Fail, FinalWeightsWritten, Finish, GenerationEnded, GenerationStepped, PreemptionNotice,
    RequestSafePoint, Retire, ScaleRequested, Spawn, Start, StartGeneration, Stop, StopRequested, Tick, WorkersReady, decide,
)
from elastic_zero.plan.membership import Member
from elastic_zero.protocol import Outcome


def _members(*ids):
    return tuple(Member(i, node=f"node-{i}") for i in ids)


def _started(n=3, min_workers=1, max_workers=4):
    s = CoordinatorState(min_workers=min_workers, max_workers=max_workers, target=n, min_wait_s=30)
    s, cmds, _ = decide(s, Start(), 0.0)
    assert cmds == (Spawn(n),)
    s, cmds, _ = decide(s, WorkersReady(_members(*[f"w{i}" for i in range(n)])), 1.0)
    (start,) = cmds
    assert isinstance(start, StartGeneration) and start.plan.source == "init" and start.plan.number == 0
    return s, start.plan


def _end(s, plan, **kinds):
    outs = []
    for aid in plan.generation.members:
        kind = kinds.get(aid.actor_id, "failed" if "dead" in kinds.values() else "safe_point")
        outs.append(Outcome(aid.actor_id, kind, step=5, own_steps=(4, 5), ward_steps=(4, 5),
                            snapshot_generation=plan.number))
    return decide(s, GenerationEnded(tuple(o for o in outs if o.kind != "dead")), 10.0)


def _cmd(cmds, kind):
    found = [c for c in cmds if isinstance(c, kind)]
    return found[0] if found else None


def test_a_lost_worker_is_rebuilt_from_its_buddy_and_replaced():
    s, plan = _started(3)
    s, cmds, reason = _end(s, plan, w1="dead")
    assert _cmd(cmds, Retire) == Retire(("w1",)) and _cmd(cmds, Spawn) is None
    new = _cmd(cmds, StartGeneration).plan
    assert new.source == "snapshot" and new.step == 5 and new.number == 1
    assert [m.actor_id for m in new.generation.members] == ["w0", "w2"]
    buddy = plan.generation.members[plan.generation.buddies[1]].actor_id
    assert new.participants[new.holder_of_old[1]] == buddy
    # the replacement is asked for once the survivors have stepped, not while they recover
    assert decide(s, GenerationStepped(0), 10.5)[1] == ()
    s, cmds, _ = decide(s, GenerationStepped(1), 10.6)
    assert cmds == (Spawn(1),)
    assert decide(s, GenerationStepped(1), 10.7)[1] == ()  # once
    # the replacement joins at the next safe point
    s, cmds, _ = decide(s, WorkersReady(_members("w3")), 11.0)
    assert cmds == (RequestSafePoint(),)
    s, cmds, _ = _end(s, new)
    joined = _cmd(cmds, StartGeneration).plan
    assert joined.source == "live" and [m.actor_id for m in joined.generation.members] == ["w0", "w2", "w3"]
    assert joined.holder_of_old == (0, 1)


def test_scale_up_then_down_at_safe_points():
    s, plan = _started(2)
    s, cmds, _ = decide(s, ScaleRequested(3), 2.0)
    assert cmds == (Spawn(1),)
    s, cmds, _ = decide(s, WorkersReady(_members("w9")), 3.0)
    assert cmds == (RequestSafePoint(),)
    s, cmds, _ = _end(s, plan)
    up = cmds[0].plan
    assert up.generation.world_size == 3 and up.previous.world_size == 2 and up.leaving == ()
    s, cmds, _ = decide(s, ScaleRequested(2), 4.0)
    assert cmds == (RequestSafePoint(),) and s.leaving == ("w9",)
    s, cmds, _ = _end(s, up)
    down = cmds[0].plan
    assert [m.actor_id for m in down.generation.members] == ["w0", "w1"]
    assert down.leaving == ("w9",) and down.participants == ("w0", "w1", "w9") and down.holder_of_old == (0, 1, 2)
    assert decide(s, ScaleRequested(9), 5.0)[1] == ()  # outside [min, max]: refused


def test_preemption_notice_leaves_at_the_next_safe_point_and_spawns_a_replacement():
    s, plan = _started(3)
    s, cmds, _ = decide(s, PreemptionNotice("w0"), 2.0)
    assert cmds == (Spawn(1), RequestSafePoint())
    s, cmds, _ = _end(s, plan)
    p = cmds[0].plan
    assert [m.actor_id for m in p.generation.members] == ["w1", "w2"] and p.leaving == ("w0",)


def test_replacements_still_due_are_neither_lost_nor_doubled():
    s, plan = _started(3)
    s, cmds, _ = _end(s, plan, w1="dead")
    new = _cmd(cmds, StartGeneration).plan
    # a preemption notice before the recovered generation reported its first step
    s1, cmds, _ = decide(s, PreemptionNotice("w0"), 10.2)
    assert cmds == (Spawn(2), RequestSafePoint())  # w0's replacement and the one still due
    s1, cmds, _ = _end(s1, new)
    assert _cmd(cmds, StartGeneration) is not None and _cmd(cmds, Spawn) is None
    # another loss before the first step: one top-up for both, after the next generation steps
    s2, cmds, _ = _end(s, new, w2="dead")
    again = _cmd(cmds, StartGeneration).plan
    assert _cmd(cmds, Spawn) is None and [m.actor_id for m in again.generation.members] == ["w0"]
    assert decide(s2, GenerationStepped(new.number), 11.0)[1] == ()
    assert decide(s2, GenerationStepped(again.number), 11.0)[1] == (Spawn(2),)


def test_below_min_workers_waits_then_recovers_or_gives_up():
    s, plan = _started(2, min_workers=2)
    s, cmds, reason = _end(s, plan, w1="dead")
    assert _cmd(cmds, StartGeneration) is None and _cmd(cmds, Spawn) == Spawn(1)
    assert decide(s, Tick(), 20.0)[1] == ()
    later, cmds, _ = decide(s, Tick(), 41.0)
    assert isinstance(cmds[0], Fail) and "below min_workers 2" in cmds[0].message
    s, cmds, _ = decide(s, WorkersReady(_members("w5")), 15.0)
    p = _cmd(cmds, StartGeneration).plan
    assert p.source == "snapshot" and [m.actor_id for m in p.generation.members] == ["w0", "w5"]


def test_losing_a_shard_and_its_replica_starts_over_or_restores_a_checkpoint_and_finishing_retires_everyone():
    s, plan = _started(4)
    buddy = plan.generation.members[plan.generation.buddies[0]].actor_id
    _, cmds, reason = _end(s, plan, w0="dead", **{buddy: "dead"})
    # nothing committed: the job starts over from its initial weights, saying what was lost
    restart = _cmd(cmds, StartGeneration).plan
    assert restart.source == "restart" and restart.step == 0 and restart.holder_of_old == () and _cmd(cmds, Fail) is None
    assert len(restart.generation.members) == 2 and restart.number == plan.number + 1
    assert "start over from the initial weights" in reason and "replicas of their shards were lost together" in reason
    assert "lost together, and no checkpoint was committed; 2 replacement(s) after its first step" in reason
    from dataclasses import replace

    with_checkpoints, _, why = decide(s, CheckpointCommitted(), 10.0)
    assert with_checkpoints.committed and why == "a checkpoint was committed"
    _, cmds, _ = _end(with_checkpoints, plan, w0="dead", **{buddy: "dead"})
    p = _cmd(cmds, StartGeneration).plan
    assert p.source == "checkpoint" and p.holder_of_old == () and _cmd(cmds, Spawn) is None
    s_ckpt, _, _ = _end(with_checkpoints, plan, w0="dead", **{buddy: "dead"})
    assert decide(s_ckpt, GenerationStepped(p.number), 11.0)[1] == (Spawn(2),)
    s2, cmds, _ = _end(s, plan, w0="finished", w1="finished", w2="finished", w3="finished")
    assert cmds == (Finish(),) and s2.finishing and not s2.done
    s3, cmds, _ = decide(s2, FinalWeightsWritten(), 12.0)
    assert cmds == (Retire(("w0", "w1", "w2", "w3")),) and s3.done


def test_a_member_lost_while_the_final_weights_are_written_is_recovered_from_the_last_steps_replicas():
    """Writing the final weights is the job's last act together: a member lost in it (its node gone)
    leaves the survivors' outcomes as they were, and the state machine recovers as for a loss in
    training; the recovered generation, at the last step, finishes at once and the save is repeated."""
    s, plan = _started(3)
    s, cmds, _ = _end(s, plan, w0="finished", w1="finished", w2="finished")
    assert cmds == (Finish(),) and s.finishing
    for event in (ScaleRequested(2), PreemptionNotice("w1"), StopRequested(), Tick()):
        s_same, cmds, reason = decide(s, event, 11.0)
        assert cmds == () and s_same == s, reason
    s, cmds, _ = decide(s, WorkersReady(_members("w9")), 11.0)  # a replacement asked for earlier
    assert cmds == () and [m.actor_id for m in s.ready] == ["w9"]
    s, cmds, reason = _end(s, plan, w0="finished", w1="dead", w2="finished")
    recovered = _cmd(cmds, StartGeneration).plan
    assert recovered.source == "snapshot" and recovered.step == 5 and not s.finishing and not s.done, reason
    assert "lost while the final weights were written" in reason
    assert sorted(m.actor_id for m in recovered.generation.members) == ["w0", "w2", "w9"]
    s, cmds, _ = _end(s, recovered, w0="finished", w2="finished", w9="finished")
    assert cmds == (Finish(),) and s.finishing
    s, cmds, _ = decide(s, FinalWeightsWritten(), 12.0)
    assert sorted(_cmd(cmds, Retire).actor_ids) == ["w0", "w2", "w9"] and s.done


def test_a_worker_told_to_leave_before_the_last_step_stays_a_member_if_the_final_save_loses_another():
    """A scale-down asked for just before the last step: the last step wins over the safe point, so
    w2 is still a member, marked to leave, when the final save loses w1. The recovery must not make w2 a
    leaver of a hand-off: with no step left, nothing would ever commit the new layout it waits for."""
    s, plan = _started(3)
    s, _, _ = decide(s, ScaleRequested(2), 2.0)
    assert s.leaving
    s, cmds, _ = _end(s, plan, w0="finished", w1="finished", w2="finished")
    assert cmds == (Finish(),) and s.leaving == ()
    s, cmds, _ = _end(s, plan, w0="finished", w1="dead", w2="finished")
    recovered = _cmd(cmds, StartGeneration).plan
    assert recovered.leaving == () and sorted(recovered.participants) == ["w0", "w2"]
    assert decide(s, FinalWeightsWritten(), 3.0)[1] == ()  # not finishing now: nothing to retire


def test_a_loss_during_a_handover_restores_the_layout_before_it_from_memory():
    from dataclasses import replace

    s, plan = _started(3)
    s, cmds, _ = decide(s, ScaleRequested(2), 2.0)
    s, cmds, _ = _end(s, plan)
    handover = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in handover.generation.members] == ["w0", "w1"] and handover.leaving == ("w2",)
    old = plan.generation

    def held(actor_id):  # replicas of generation 0's ranks, as before the handover
        return Outcome(actor_id, "failed", step=5, own_steps=(4, 5), ward_steps=(4, 5), snapshot_generation=old.number)

    # w1 dies inside the handover: no rank committed generation 1, but w0 and the leaver w2 still
    # hold generation 0's shards and replicas
    s2, cmds, _ = decide(s, GenerationEnded((held("w0"), held("w2"))), 10.0)
    restore = _cmd(cmds, StartGeneration).plan
    assert _cmd(cmds, Fail) is None and _cmd(cmds, Retire) == Retire(("w1",))
    assert restore.source == "snapshot" and restore.step == 5 and restore.previous == old
    assert restore.number == handover.number + 1  # the failed generation's store keys stay taken
    assert [m.actor_id for m in restore.generation.members] == ["w0"] and restore.leaving == ("w2",)
    buddy_of_1 = old.members[old.buddies[1]].actor_id
    assert [restore.participants[h] for h in restore.holder_of_old] == ["w0", buddy_of_1, "w2"]
    assert decide(s2, GenerationStepped(restore.number), 11.0)[1] == (Spawn(1),)  # back to 2 after its first step
    # a rank whose generation-1 replicas do not cover every rank falls back to `earlier`, the
    # generation-0 replicas it keeps until every rank has committed: the same plan
    partial = replace(held("w0"), own_steps=(5,), ward_steps=(), snapshot_generation=handover.number,
                      earlier=(old.number, (4, 5), (4, 5)))
    assert _cmd(decide(s, GenerationEnded((partial, held("w2"))), 10.0)[1], StartGeneration).plan == restore
    # w0 holding w1's generation-1 replica as well: generation 1 itself is restored, the leaver retired
    complete = replace(partial, ward_steps=(5,))
    _, cmds, _ = decide(s, GenerationEnded((complete, held("w2"))), 10.0)
    assert _cmd(cmds, StartGeneration).plan.previous == handover.generation and Retire(("w2",)) in cmds
    # the leaver lost too: generation 0's ranks 1 and 2 cannot both be held by w0
    _, cmds, reason = decide(s, GenerationEnded((held("w0"),)), 10.0)
    assert _cmd(cmds, StartGeneration).plan.source == "restart" and _cmd(cmds, Fail) is None
    assert "lost before generation 1 committed its layout" in reason and "start over from the initial weights" in reason
    _, cmds, _ = decide(replace(s, committed=True), GenerationEnded((held("w0"),)), 10.0)
    from_checkpoint = _cmd(cmds, StartGeneration).plan
    assert from_checkpoint.source == "checkpoint" and from_checkpoint.holder_of_old == ()
    assert [m.actor_id for m in from_checkpoint.generation.members] == ["w0"]
    assert _cmd(cmds, Retire) == Retire(("w1", "w2"))
    # once every rank committed generation 1 (the leaver has left), its own layout is restored
    fresh = (replace(held("w0"), snapshot_generation=handover.number), Outcome("w2", "left", step=5))
    _, cmds, _ = decide(s, GenerationEnded(fresh), 10.0)
    again = _cmd(cmds, StartGeneration).plan
    assert again.source == "snapshot" and again.previous == handover.generation and again.participants == ("w0",)


def test_a_loss_in_the_first_step_after_a_scale_up_restores_the_layout_before_it():
    """A scale-up commits at its first step, not in the pause: until then the members report the
    previous layout's replicas, and a loss restores that layout's step into the survivors."""
    s, plan = _started(2)
    s, _, _ = decide(s, ScaleRequested(3), 2.0)
    s, _, _ = decide(s, WorkersReady(_members("w9")), 3.0)
    s, cmds, _ = _end(s, plan)
    up = _cmd(cmds, StartGeneration).plan
    old = plan.generation
    before = [Outcome(a, "failed", step=6, own_steps=(4, 5), ward_steps=(4, 5), snapshot_generation=old.number)
              for a in ("w0", "w1")]
    joiner = Outcome("w9", "failed", step=6)  # holds nothing yet
    # w1 is lost: w0 holds rank 0 and, as its buddy, rank 1's replica of step 5
    _, cmds, _ = decide(s, GenerationEnded((before[0], joiner)), 10.0)
    restore = _cmd(cmds, StartGeneration).plan
    assert restore.source == "snapshot" and restore.step == 5 and restore.previous == old
    assert [m.actor_id for m in restore.generation.members] == ["w0", "w9"] and restore.number == up.number + 1
    assert [restore.participants[h] for h in restore.holder_of_old] == ["w0", "w0"]


def test_a_preempted_worker_waits_for_its_replacement_when_leaving_would_go_below_min_workers():
    s, plan = _started(2, min_workers=2, max_workers=2)
    s, cmds, reason = decide(s, PreemptionNotice("w0"), 2.0)
    assert cmds == (Spawn(1),) and "wait for replacements" in reason  # no safe point yet
    s, cmds, _ = decide(s, WorkersReady(_members("w2")), 3.0)
    assert cmds == (RequestSafePoint(),)
    s, cmds, _ = _end(s, plan)
    swap = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in swap.generation.members] == ["w1", "w2"] and swap.leaving == ("w0",)


def test_a_notice_for_every_member_asks_for_a_checkpoint_once_and_plans_no_resize():
    """One notice for the whole node (every member at once): nobody can take the shards, and each
    shard's replica is on a leaver too, so a checkpoint now; no safe point (the same members would
    only be planned again), and one request per generation however many notices come."""
    s, plan = _started(2, min_workers=1, max_workers=2)
    s, cmds, reason = decide(s, PreemptionNotice("w0", ("w1",)), 2.0)
    assert cmds == (Spawn(2), CheckpointNow()) and "checkpoint now" in reason
    assert s.leaving == ("w0", "w1") and not s.safe_point_requested
    s, cmds, _ = decide(s, PreemptionNotice("w1"), 2.5)  # a second source says the same
    assert _cmd(cmds, CheckpointNow) is None and _cmd(cmds, RequestSafePoint) is None
    # the replacements join at a safe point, and the leavers hand over then
    s, cmds, _ = decide(s, WorkersReady(_members("w2", "w3")), 3.0)
    assert cmds == (RequestSafePoint(),)
    s, cmds, _ = _end(s, plan)
    swap = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in swap.generation.members] == ["w2", "w3"] and swap.leaving == ("w0", "w1")


def test_a_leaver_whose_replica_stays_asks_for_no_checkpoint():
    """w0 waits for its replacement (min_workers 2), but its buddy w1 stays: memory covers it."""
    s, plan = _started(2, min_workers=2, max_workers=2)
    s, cmds, _ = decide(s, PreemptionNotice("w0"), 2.0)
    assert _cmd(cmds, CheckpointNow) is None


def test_a_worker_that_cannot_start_ends_a_job_that_has_not_started():
    from elastic_zero.coordinator.state import WorkerStartFailed

    s = CoordinatorState(min_workers=1, max_workers=3, target=2)
    s, _, _ = decide(s, Start(), 0.0)
    s, cmds, _ = decide(s, WorkerStartFailed("w1", "data.source: no dataset at '/no/such'"), 1.0)
    (fail,) = cmds
    assert isinstance(fail, Fail) and fail.message == "worker w1 failed to start: data.source: no dataset at '/no/such'"
    assert s.done


def test_a_replacement_that_cannot_start_is_retried_once_then_ends_the_job():
    from elastic_zero.coordinator.state import WorkerStartFailed

    s, plan = _started(3)
    s, cmds, _ = _end(s, plan, w1="dead")
    s, cmds, _ = decide(s, GenerationStepped(s.generation.number), 11.0)
    assert _cmd(cmds, Spawn) == Spawn(1)
    s, cmds, _ = decide(s, WorkerStartFailed("w3", "MemoryError: building the model"), 12.0)
    assert cmds == (Spawn(1),) and not s.done  # once may be the machine
    s, cmds, _ = decide(s, WorkerStartFailed("w4", "MemoryError: building the model"), 13.0)
    assert isinstance(_cmd(cmds, Fail), Fail) and "w4 failed to start: MemoryError" in cmds[0].message


def test_a_notice_for_a_worker_ready_to_join_retires_it_and_asks_for_another():
    """A node told to go may hold a worker that is ready but has not joined yet: it goes at once
    (it holds no shard), leaves the ready list (a retired worker must never be planned in), and a
    replacement is asked for."""
    s, plan = _started(2)
    s, cmds, _ = decide(s, ScaleRequested(3), 2.0)
    assert _cmd(cmds, Spawn) == Spawn(1)
    s, _, _ = decide(s, WorkersReady(_members("w2")), 3.0)
    assert [m.actor_id for m in s.ready] == ["w2"]
    s, cmds, reason = decide(s, PreemptionNotice("w2"), 4.0)
    assert _cmd(cmds, Retire) == Retire(("w2",)) and _cmd(cmds, Spawn) == Spawn(1) and s.ready == ()
    assert "before it joined" in reason
    s, cmds, _ = _end(s, plan)  # the safe point asked for the join: nobody joins, the members go on
    start = _cmd(cmds, StartGeneration)
    assert start is None or "w2" not in start.plan.participants


def test_replacements_lost_while_they_start_are_asked_for_again_a_few_times_in_a_row():
    """A replacement placed on a node that then vanished dies in Ray's hands, not by its own
    start: that is no bug of the job, so it never ends a running job (seen: two replacements on a
    frozen node ended the job as 'cannot start')."""
    from elastic_zero.coordinator.state import MAX_START_LOSSES, WorkerStartFailed

    s, plan = _started(3)
    s, cmds, _ = _end(s, plan, w1="dead")
    s, cmds, _ = decide(s, GenerationStepped(s.generation.number), 11.0)
    died = "The actor died unexpectedly before finishing this task."
    for i in range(MAX_START_LOSSES):
        s, cmds, reason = decide(s, WorkerStartFailed(f"w{3 + i}", died, lost=True), 12.0 + i)
        assert cmds == (Spawn(1),) and not s.done and "another is asked for" in reason
    s, cmds, reason = decide(s, WorkerStartFailed("w9", died, lost=True), 20.0)
    assert cmds == () and not s.done and "no replacement for now" in reason
    s, _, _ = decide(s, WorkersReady((Member("w10", "n1"),)), 21.0)  # one made it: the count starts again
    assert s.start_losses == 0


def test_the_same_error_on_two_generations_ends_the_job():
    """A worker's own exception (not a lost peer) that comes back after a recovery is a bug:
    replacing workers forever would never mend it."""
    s, plan = _started(3)
    bug = "RuntimeError: index out of range"
    fail = lambda p, who: tuple(Outcome(m.actor_id, "failed", step=5, own_steps=(5,), ward_steps=(5,),
                                        snapshot_generation=p.number, bug=bug if m.actor_id == who else "")
                                for m in p.generation.members if m.actor_id != "w2")
    s, cmds, _ = decide(s, GenerationEnded(fail(plan, "w0")), 10.0)  # w2 died as well: a recovery
    start = _cmd(cmds, StartGeneration)
    assert start is not None and not s.done
    s, cmds, _ = decide(s, GenerationEnded(fail(start.plan, "w0")), 20.0)
    assert s.done and _cmd(cmds, Fail).message == f"the same error ended two generations: {bug}"


def test_the_phases_of_a_job_and_the_decision_object():
    from elastic_zero.coordinator.state import Decision, Phase

    s = CoordinatorState(min_workers=2, max_workers=3, target=2)
    assert s.phase is Phase.STARTING
    s, _, _ = decide(s, Start(), 0.0)
    decision = decide(s, WorkersReady(_members("w0", "w1")), 1.0)
    assert isinstance(decision, Decision) and decision.reason == "generation 0 with 2 workers"
    s, plan = decision.state, decision.commands[0].plan
    assert s.phase is Phase.RUNNING
    s, cmds, _ = _end(s, plan, w1="dead")  # one survivor, below min_workers: wait for a replacement
    assert s.phase is Phase.WAITING and _cmd(cmds, Spawn) == Spawn(1)
    s, cmds, reason = decide(s, Tick(), 100.0)
    assert s.phase is Phase.DONE and isinstance(_cmd(cmds, Fail), Fail) and reason == "gave up waiting for workers"
    assert decide(s, Tick(), 101.0).reason == "the job is over"


def test_a_stop_ends_the_job_at_the_next_safe_point_with_its_checkpoint():
    # before any generation: nothing to save, the job ends at once
    s = CoordinatorState(min_workers=1, max_workers=4, target=2)
    s, _, _ = decide(s, Start(), 0.0)
    s, cmds, _ = decide(s, StopRequested(checkpoint=True), 0.5)
    assert _cmd(cmds, Stop) == Stop(-1, False) and s.done
    # waiting for workers below min_workers: no safe point will come, the job ends as it is
    s, plan = _started(2, min_workers=2)
    s, cmds, _ = _end(s, plan, w1="dead")
    assert s.phase.value == "waiting"
    s, cmds, _ = decide(s, StopRequested(), 12.0)
    assert _cmd(cmds, Stop) == Stop(-1, False) and "w0" in _cmd(cmds, Retire).actor_ids and s.done

    s, plan = _started(3)
    s, cmds, reason = decide(s, StopRequested(checkpoint=True), 2.0)
    assert cmds == (RequestSafePoint(),) and "next safe point" in reason
    assert decide(s, StopRequested(checkpoint=False), 2.1)[1] == ()  # asked once; the checkpoint wish stays
    # a scale request meanwhile changes nothing: the stop wins at the safe point
    s, _, _ = decide(s, ScaleRequested(4), 2.2)
    s, cmds, reason = _end(s, plan)
    assert _cmd(cmds, Stop) == Stop(5, True) and _cmd(cmds, StartGeneration) is None and s.done
    assert set(_cmd(cmds, Retire).actor_ids) >= {"w0", "w1", "w2"}
    assert "stopped on request at step 5" in reason


def test_a_stop_asked_during_a_failure_is_asked_again_of_the_recovered_generation():
    s, plan = _started(3)
    s, _, _ = decide(s, StopRequested(), 2.0)
    s, cmds, _ = _end(s, plan, w1="dead")  # the safe point never came: a worker was lost first
    recovered = _cmd(cmds, StartGeneration).plan
    assert recovered.source == "snapshot" and _cmd(cmds, RequestSafePoint) == RequestSafePoint()
    assert cmds.index(_cmd(cmds, RequestSafePoint)) > cmds.index(_cmd(cmds, StartGeneration))
    s, cmds, _ = _end(s, recovered)
    assert _cmd(cmds, Stop) == Stop(5, False) and s.done
    # a generation that finished training meanwhile simply finishes
    s, plan = _started(2)
    s, _, _ = decide(s, StopRequested(), 2.0)
    s, cmds, _ = _end(s, plan, w0="finished", w1="finished")
    assert _cmd(cmds, Finish) == Finish() and _cmd(cmds, Stop) is None


def test_joiners_ready_within_the_window_join_at_one_safe_point():
    """The issue's case: a replacement after a loss and a scale-up start together; the first ready
    waits for the other (still starting) instead of a resize of its own."""
    s, plan = _started(2)
    s, cmds, _ = _end(s, plan, w1="dead")
    recovered = _cmd(cmds, StartGeneration).plan
    s, cmds, _ = decide(s, GenerationStepped(recovered.number), 10.5)
    assert cmds == (Spawn(1),)
    s, cmds, _ = decide(s, ScaleRequested(3), 10.6)
    assert cmds == (Spawn(1),)
    s, cmds, reason = decide(s, WorkersReady(_members("w2")), 12.0)
    assert cmds == () and "1 still starting" in reason
    assert decide(s, Tick(), 14.0)[1] == ()  # within the window: still waiting
    s, cmds, _ = decide(s, WorkersReady(_members("w3")), 15.0)
    assert cmds == (RequestSafePoint(),)
    s, cmds, _ = _end(s, recovered)
    joined = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in joined.generation.members] == ["w0", "w2", "w3"] and s.ready == ()


def test_a_joiner_waits_no_longer_than_the_window_and_leavers_never_wait():
    s, plan = _started(2)
    s, cmds, _ = decide(s, ScaleRequested(4), 2.0)
    assert cmds == (Spawn(2),)
    s, cmds, _ = decide(s, WorkersReady(_members("w2")), 3.0)
    assert cmds == ()
    s_late, cmds, _ = decide(s, Tick(), 3.0 + s.join_window_s)  # the other is late: w2 joins alone
    assert cmds == (RequestSafePoint(),)
    s_late, cmds, _ = _end(s_late, plan)
    assert [m.actor_id for m in _cmd(cmds, StartGeneration).plan.generation.members] == ["w0", "w1", "w2"]
    # a notice while a joiner waits: the leaver does not wait for the window
    s, cmds, _ = decide(s, PreemptionNotice("w0"), 3.5)
    assert RequestSafePoint() in cmds
    # with no window, a ready joiner asks at once, as before
    s0, plan0 = _started(2)
    s0 = CoordinatorState(**{**s0.__dict__, "join_window_s": 0.0})
    s0, cmds, _ = decide(s0, ScaleRequested(4), 2.0)
    assert decide(s0, WorkersReady(_members("w2")), 3.0)[1] == (RequestSafePoint(),)


def _ended_without_replicas(s, plan, **kinds):
    """As _end, for a job that keeps no replicas (elastic.replicate_every = 0): nothing held."""
    outs = [Outcome(m.actor_id, kinds.get(m.actor_id, "failed"), step=5) for m in plan.generation.members]
    return decide(s, GenerationEnded(tuple(o for o in outs if o.kind != "dead")), 10.0)


def test_without_replicas_a_loss_restores_the_checkpoint_or_starts_over_naming_the_setting():
    from dataclasses import replace

    s, plan = _started(3)
    s = replace(s, replicated=False)
    _, cmds, reason = _ended_without_replicas(s, plan, w1="dead")
    assert _cmd(cmds, StartGeneration).plan.source == "restart" and _cmd(cmds, Fail) is None
    assert "replication is off (elastic.replicate_every = 0), and no checkpoint was committed" in reason
    _, cmds, _ = _ended_without_replicas(replace(s, committed=True), plan, w1="dead")
    assert _cmd(cmds, StartGeneration).plan.source == "checkpoint"


def test_without_replicas_a_leaver_waiting_for_its_replacement_asks_for_a_checkpoint():
    """With replicas, w0's buddy w1 would cover it (the test above this one's neighbour); without,
    its shard exists only in w0 until the handover: a checkpoint of the step reached, now."""
    from dataclasses import replace

    s, plan = _started(2, min_workers=2, max_workers=2)
    s, cmds, _ = decide(replace(s, replicated=False), PreemptionNotice("w0"), 2.0)
    assert _cmd(cmds, CheckpointNow) == CheckpointNow()


def test_standby_workers_wait_ready_beside_the_generation_and_replace_a_loss_at_once():
    """elastic.standby_workers: started with the job, never a member until a loss, which they make
    good in the recovery itself (no spawn to wait for); then they are topped back up, and a scale
    keeps them beside its target. Oracle: the same loss without standby, which waits for nothing
    but replaces only after the survivors stepped."""
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, min_wait_s=30, standby=1)
    s, cmds, reason = decide(s, Start(), 0.0)
    assert cmds == (Spawn(3),) and reason == "start 2 workers and 1 on standby"
    s, cmds, _ = decide(s, WorkersReady(_members("w0", "w1", "w2")), 1.0)
    (start,) = cmds
    assert [m.actor_id for m in start.plan.generation.members] == ["w0", "w1"]
    assert [m.actor_id for m in s.ready] == ["w2"] and decide(s, Tick(), 1.5)[1] == ()  # no safe point for it
    s, cmds, _ = _end(s, start.plan, w1="dead")
    new = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in new.generation.members] == ["w0", "w2"] and new.source == "snapshot"
    assert _cmd(cmds, Spawn) is None and s.ready == ()
    s, cmds, _ = decide(s, GenerationStepped(1), 10.6)
    assert cmds == (Spawn(1),)  # the standby, again
    s, cmds, _ = decide(s, WorkersReady(_members("w3")), 11.0)
    assert cmds == () and [m.actor_id for m in s.ready] == ["w3"]
    s, cmds, _ = decide(s, ScaleRequested(1), 12.0)  # a scale-down keeps the standby
    assert _cmd(cmds, Retire) is None and [m.actor_id for m in s.ready] == ["w3"]
    # a scale-up to 3 (w2 still to leave): the standby joins at the safe point the scale-down asked
    # for; one more member and a new standby are asked for
    s, cmds, _ = decide(s, ScaleRequested(3), 13.0)
    assert _cmd(cmds, Spawn) == Spawn(2) and s.safe_point_requested


def test_a_standby_that_dies_while_it_waits_is_replaced_then_not_when_a_recovery_takes_it():
    """A ready worker has no call of ours in flight to say it died: before, a dead standby was found
    only by the recovery that took it (a generation failed at its start, and another spawned). Found
    by its last word or its silence, it goes at once and another is asked for; the recovery that
    follows takes the replacement. While the final weights are written, none is asked for."""
    from elastic_zero.coordinator.state import ReadyWorkersLost

    s = CoordinatorState(min_workers=1, max_workers=4, target=2, min_wait_s=30, standby=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, (start,), _ = decide(s, WorkersReady(_members("w0", "w1", "w2")), 1.0)
    s, cmds, reason = decide(s, ReadyWorkersLost(("w2",), "its process ended"), 2.0)
    assert cmds == (Retire(("w2",), lost=True), Spawn(1)) and s.ready == () and s.spawning == 1
    assert reason == "w2 lost while ready (its process ended): retired; 1 more asked for"
    s, cmds, _ = decide(s, WorkersReady(_members("w3")), 3.0)
    assert cmds == () and [m.actor_id for m in s.ready] == ["w3"]
    s, cmds, _ = _end(s, start.plan, w1="dead")  # the recovery takes the replacement, not the dead one
    assert [m.actor_id for m in _cmd(cmds, StartGeneration).plan.generation.members] == ["w0", "w3"]
    # a member, or one no longer ready, is not this event's to retire (the generation's reports are)
    s2, cmds, reason = decide(s, ReadyWorkersLost(("w0",), "silent"), 4.0)
    assert cmds == () and s2 == s and "not among the ready workers" in reason
    # while the final weights are written: out, and none asked for
    f = replace(s, finishing=True, ready=_members("w4"))
    f, cmds, _ = decide(f, ReadyWorkersLost(("w4",), "silent"), 5.0)
    assert cmds == (Retire(("w4",), lost=True),) and f.ready == ()


def test_a_ready_worker_lost_while_a_recovery_waits_is_replaced_one_for_one():
    """Found by review: while a recovery waits, the failed generation's dead members still count as
    staying, so topping up after a ready joiner died asked for nobody, and the job failed below
    min_workers; and with standby workers a top-up asked early for the replacement the recovery puts
    off until the survivors step. Each lost ready worker is replaced by exactly one."""
    from elastic_zero.coordinator.state import ReadyWorkersLost

    s, plan = _started(3, min_workers=3)
    s, cmds, _ = _end(s, plan, w1="dead", w2="dead")
    assert _cmd(cmds, Spawn) == Spawn(2) and s.recovery is not None
    s, _, _ = decide(s, WorkersReady(_members("w3")), 11.0)
    s, cmds, _ = decide(s, ReadyWorkersLost(("w3",), "its process ended"), 12.0)
    assert cmds == (Retire(("w3",), lost=True), Spawn(1)) and s.spawning == 2
    s, _, _ = decide(s, WorkersReady(_members("w4")), 13.0)
    s, cmds, _ = decide(s, WorkersReady(_members("w5")), 14.0)
    assert sorted(m.actor_id for m in _cmd(cmds, StartGeneration).plan.generation.members) == ["w0", "w4", "w5"]
    # with a standby: the recovery takes it and puts the replacement off; a second standby lost meanwhile
    # is replaced alone
    s = CoordinatorState(min_workers=1, max_workers=4, target=2, min_wait_s=30, standby=2)
    s, _, _ = decide(s, Start(), 0.0)
    s, (start,), _ = decide(s, WorkersReady(_members("w0", "w1", "w2", "w3")), 1.0)
    s, cmds, _ = _end(s, start.plan, w1="dead")
    assert _cmd(cmds, Spawn) is None and [m.actor_id for m in s.ready] == ["w3"]
    s, cmds, _ = decide(s, ReadyWorkersLost(("w3",), "silent"), 11.0)
    assert cmds == (Retire(("w3",), lost=True), Spawn(1))
    s, cmds, _ = decide(s, GenerationStepped(1), 12.0)
    assert cmds == (Spawn(1),)  # the one put off, now


def test_a_joiners_wait_ends_with_the_last_ready_one():
    """A joiner waits up to the join window for workers still starting; when it dies, a later joiner's
    window starts anew rather than from the dead one's."""
    from elastic_zero.coordinator.state import ReadyWorkersLost

    s, plan = _started(2)
    s, _, _ = decide(s, ScaleRequested(4), 2.0)
    s, cmds, _ = decide(s, WorkersReady(_members("w2")), 3.0)
    assert s.joiners_wait_since is not None and _cmd(cmds, RequestSafePoint) is None
    s, _, _ = decide(s, ReadyWorkersLost(("w2",), "its process ended"), 4.0)
    assert s.joiners_wait_since is None and s.spawning == 2
    s, cmds, _ = decide(s, WorkersReady(_members("w4")), 21.0)
    assert _cmd(cmds, RequestSafePoint) is None and s.joiners_wait_since == 21.0


def test_a_scale_up_takes_a_ready_standby_at_once_and_a_standby_that_cannot_start_fails_nothing():
    """The join window waits for workers still starting only while the ready ones do not fill the
    target: a standby fills it, and the one starting to replace it would join nothing. A standby
    whose start fails leaves the job training, with a warning, and is not asked for again."""
    from elastic_zero.coordinator.state import Warn, WorkerStartFailed

    s = CoordinatorState(min_workers=1, max_workers=4, target=2, min_wait_s=30, standby=1)
    s, _, _ = decide(s, Start(), 0.0)
    s, (start,), _ = decide(s, WorkersReady(_members("w0", "w1", "w2")), 1.0)
    s, cmds, _ = decide(s, ScaleRequested(3), 2.0)
    assert _cmd(cmds, Spawn) == Spawn(1) and _cmd(cmds, RequestSafePoint) is not None  # no wait for the new standby
    s, cmds, _ = _end(s, start.plan)
    up = _cmd(cmds, StartGeneration).plan
    assert [m.actor_id for m in up.generation.members] == ["w0", "w1", "w2"]
    s, cmds, reason = decide(s, WorkerStartFailed("w3", "OSError: no space left on device"), 3.0)
    assert not any(isinstance(c, Fail) for c in cmds) and s.standby == 0 and "a standby worker" in reason
    (warn,) = cmds
    assert isinstance(warn, Warn) and "goes on with 0 standby worker(s)" in warn.message
    assert decide(s, GenerationStepped(up.number), 4.0)[1] == ()  # none asked for again


def test_a_taken_over_generation_fails_everywhere_without_a_loss_and_recovers_from_memory():
    """Its workers failed because the store went with the lost coordinator (a loss inside an entry),
    not because of a bug: the replacement restores from their memory. The same reports from a
    generation this coordinator ran are a failure with no lost worker: the job fails (the oracle)."""
    from elastic_zero.coordinator.transitions import taken_over

    s, plan = _started(3)
    outs = tuple(Outcome(m.actor_id, "failed", step=5, own_steps=(4, 5), ward_steps=(4, 5), snapshot_generation=0,
                         error="DistNetworkError: the store closed") for m in plan.generation.members)
    assert isinstance(_cmd(decide(s, GenerationEnded(outs), 10.0)[1], Fail), Fail)
    fresh = CoordinatorState(min_workers=1, max_workers=4, target=2, first_generation=1)  # a replacement's
    t = taken_over(fresh, plan, 3, False, False, committed=False)
    assert t.members() == ("w0", "w1", "w2") and t.running and t.target == 3 and t.first_generation == 1
    t, cmds, reason = decide(t, GenerationEnded(outs, coordinator_lost=True), 10.0)
    new = _cmd(cmds, StartGeneration).plan
    assert new.source == "snapshot" and new.step == 5 and new.number == 1 and _cmd(cmds, Fail) is None


def test_a_taken_over_generation_stopped_at_a_safe_point_goes_on_from_live_shards():
    from elastic_zero.coordinator.transitions import taken_over

    s, plan = _started(2)
    # the lost coordinator was asked to scale to 3: the generation goes on at its 2, and the third is
    # asked for as it ends (the workers it had beside the generation are not taken over)
    t = taken_over(CoordinatorState(min_workers=1, max_workers=4, target=2), plan, 3, False, False, committed=False)
    outs = tuple(Outcome(m.actor_id, "safe_point", step=16) for m in plan.generation.members)
    t, cmds, reason = decide(t, GenerationEnded(outs, coordinator_lost=True), 10.0)
    new = _cmd(cmds, StartGeneration).plan
    assert new.source == "live" and new.step == 16 and new.cause == "coordinator" and "coordinator's loss" in reason
    assert [m.actor_id for m in new.generation.members] == ["w0", "w1"] and _cmd(cmds, Spawn) == Spawn(1)


def test_a_stop_asked_of_the_lost_coordinator_is_carried_out_by_its_replacement():
    from elastic_zero.coordinator.takeover import carried_over, spawned_ids
    from elastic_zero.coordinator.transitions import taken_over

    events = [{"event": "spawn", "actor_ids": ["w0", "w1"]}, {"event": "scale_requested", "workers": 3},
              {"event": "spawn", "actor_ids": ["w2"]}, {"event": "stop_requested", "checkpoint": True}]
    assert carried_over(events, 2) == (3, True, True) and spawned_ids(events) == ["w0", "w1", "w2"]
    assert carried_over(events + [{"event": "job_stopped", "step": 9}], 2)[1:] == (False, True)
    assert carried_over([], 2) == (2, False, False)
    s, plan = _started(2)
    t = taken_over(CoordinatorState(min_workers=1, max_workers=4, target=2), plan, *carried_over(events, 2),
                   committed=False)
    outs = tuple(Outcome(m.actor_id, "safe_point", step=16) for m in plan.generation.members)
    t, cmds, reason = decide(t, GenerationEnded(outs, coordinator_lost=True), 10.0)
    assert _cmd(cmds, Stop) == Stop(16, True) and _cmd(cmds, StartGeneration) is None and t.done
