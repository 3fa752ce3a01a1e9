"""The coordinator's books (coordinator/books.py): step times on one rank's clock, the share of each
step spent protecting it, and a recovery that had no step left to run."""

import pytest

from elastic_zero.coordinator.books import Books
from elastic_zero.protocol import Outcome, Report

pytestmark = pytest.mark.unit


def _report(actor_id, rank, times, protect, first_step_at=10.0, kind="finished", step=3, received_bytes=0):
    ends = tuple(first_step_at + sum(times[:i + 1]) for i in range(len(times))) if first_step_at else ()
    return Report(Outcome(actor_id, kind, step), ended_at=20.0, rank=rank, step_times=tuple(times),
                  step_ends=ends, protect_times=tuple(protect), losses=tuple((s, 1.0) for s in range(len(times))),
                  first_step_at=first_step_at, received_bytes=received_bytes)


def test_step_times_are_rank_0s_and_their_protected_share_is_kept_apart():
    """Rank 1 measured its steps out of phase with rank 0 (it waited in another collective): a
    maximum over ranks would add 0.9 + 0.9 where rank 0's steps took 0.5 + 0.9."""
    books = Books(global_batch=8, steps=2, started_at=0.0)
    books.add_generation_results(0, [_report("w1", 1, [0.9, 0.5], [0.0, 0.2]), _report("w0", 0, [0.5, 0.9], [0.1, 0.2])])
    summary = books.summary(None)
    assert summary["step_time_curve"] == [(0, 0.5), (1, 0.9)]
    assert summary["protect_time_curve"] == [(0, 0.1), (1, 0.2)]
    assert summary["step_end_curve"] == [(0, 10.5), (1, 11.4)]  # rank 0's clock too


def test_a_change_records_what_its_busiest_receiver_took_in():
    books = Books(global_batch=8, steps=4, started_at=0.0)
    books.add_generation_results(0, [_report("w0", 0, [0.5], [0.0], received_bytes=100),
                                     _report("w1", 1, [0.5], [0.0], received_bytes=300)])
    assert books.summary(None)["start"]["received_bytes"] == 300  # the first generation's (a resume)
    books.begin_change("recovery", 12.0, step=1, cause="lost w1", reached=1)
    books.add_generation_results(1, [_report("w0", 0, [0.5], [0.0], first_step_at=13.0, received_bytes=700),
                                     _report("w2", 1, [0.5], [0.0], first_step_at=13.0, received_bytes=500)])
    (recovery,) = books.summary(None)["recoveries"]
    assert recovery["received_bytes"] == 700


def test_a_start_and_a_recovery_name_the_start_of_the_worker_they_waited_for():
    """The first generation waited for its last worker to say hello; a recovery, for the workers that
    said it after the failure (a standby ready before it was not waited for); a worker that told no
    start (a simulated one) is left out."""
    books = Books(global_batch=8, steps=4, started_at=0.0)
    books.worker_ready("w1", 3.0, {"ray": 0.5, "imports": 1.5})
    books.worker_ready("w0", 2.0, {"ray": 0.4, "imports": 1.2})
    books.worker_ready("w2", 4.0, {"ray": 0.6, "imports": 1.4})  # a standby: ready, outside the generation
    books.worker_ready("w9", 5.0, {})
    books.add_generation_results(0, [_report("w0", 0, [0.5], [0.0]), _report("w1", 1, [0.5], [0.0])])
    assert books.summary(None)["start"]["worker_start_s"] == {"ray": 0.5, "imports": 1.5}
    books.begin_change("recovery", 12.0, step=1, cause="lost w1", reached=1)
    books.add_generation_results(1, [_report("w0", 0, [0.5], [0.0], first_step_at=13.0),
                                     _report("w2", 1, [0.5], [0.0], first_step_at=13.0)])
    books.begin_change("recovery", 20.0, step=2, cause="lost w2", reached=2)
    books.worker_ready("w3", 22.5, {"ray": 0.7, "imports": 1.1, "model": 0.2})
    books.worker_ready("w4", 23.0, {"ray": 0.3, "imports": 1.3, "model": 0.3})
    books.add_generation_results(2, [_report("w0", 0, [0.5], [0.0], first_step_at=24.0),
                                     _report("w3", 1, [0.5], [0.0], first_step_at=24.0),
                                     _report("w4", 2, [0.5], [0.0], first_step_at=24.0),
                                     _report("w9", 3, [0.5], [0.0], first_step_at=24.0)])
    by_standby, by_new_workers = books.summary(None)["recoveries"]
    assert by_standby["worker_start_s"] is None and by_standby["worker_ready_after_s"] is None
    assert by_new_workers["worker_start_s"] == {"ray": 0.3, "imports": 1.3, "model": 0.3}  # w4: the last ready
    assert by_new_workers["worker_ready_after_s"] == 3.0  # its hello, 3 s after the failure


def test_a_start_over_that_read_the_resumed_checkpoint_restarted_from_its_step():
    """A job resumed from another run's checkpoint (step 20) loses a worker before it commits one of
    its own, with no replicas: it starts over, which reads that checkpoint again. The change restarted
    from step 20, not 0: 5 steps lost, not 25."""
    books = Books(global_batch=8, steps=40, started_at=0.0)
    books.world_size_history.append([20, 2])
    books.begin_change("recovery", 12.0, 1, step=0, cause="lost w1; started over", source="restart", reached=25)
    books.world_size_history.append([0, 2])
    books.restored(1, 20)
    books.add_generation_results(1, [_report("w0", 0, [0.5], [0.0], first_step_at=13.0),
                                     _report("w2", 1, [0.5], [0.0], first_step_at=13.0)])
    (recovery,) = books.summary(None)["recoveries"]
    assert recovery["step"] == 20 and recovery["lost_steps"] == 5
    assert books.summary(None)["world_size_history"][-1] == [20, 2]


def test_without_rank_0s_report_another_ranks_clock_is_used():
    books = Books(global_batch=8, steps=2, started_at=0.0)
    books.add_generation_results(0, [_report("w1", 1, [0.7, 0.6], [0.1, 0.1])])
    assert books.summary(None)["step_time_curve"] == [(0, 0.7), (1, 0.6)]


def test_a_recovery_with_no_step_left_is_closed_when_its_generation_finishes():
    """A member lost in the final save: the recovered generation runs no step; the recovery's stall
    lasts until that generation ended, nothing was recomputed, there is no next step."""
    books = Books(global_batch=8, steps=3, started_at=0.0)
    books.begin_change("recovery", 15.0, step=3, cause="lost w1", reached=3)
    books.add_generation_results(1, [_report("w0", 0, [], [], first_step_at=None),
                                     _report("w2", 1, [], [], first_step_at=None)])
    (recovery,) = books.summary(None)["recoveries"]
    assert recovery == {"step": 3, "cause": "lost w1", "lost_steps": 0, "recomputed_steps": 0, "failed_at": 15.0,
                        "stall_s": 5.0, "to_next_step_done_s": None, "first_step_s": None, "worker_start_s": None,
                        "worker_ready_after_s": None}
    assert books.pending_change is None


def test_a_recovery_from_a_checkpoint_no_member_read_has_its_counts_unknown_on_every_path():
    """The step a checkpoint recovery restarts from is known once a member logged it. A generation
    that trained but logged no step, one that finished in the final save without a step, and one lost
    whole after its first step all close the recovery without it: its lost and recomputed steps are
    None (unknown) on every path, never a made-up 0."""
    dead = Report(Outcome("w0", "dead", error="lost"), ended_at=30.0)
    for report in (_report("w0", 0, [0.5], [0.0], first_step_at=13.0), _report("w0", 0, [], [], first_step_at=None),
                   dead):
        books = Books(global_batch=8, steps=4, started_at=0.0)
        books.begin_change("recovery", 12.0, 1, step=None, cause="lost w1; restored from a checkpoint", reached=3)
        books.generation_stepped(1, 14.0)
        books.add_generation_results(1, [report])
        (recovery,) = books.summary(None)["recoveries"]
        assert recovery["lost_steps"] is None and recovery["recomputed_steps"] is None, recovery


def _dead(actor_id):
    return Report(Outcome(actor_id, "dead", error="lost"), ended_at=30.0)


def test_a_change_whose_generation_stepped_then_was_lost_whole_is_kept():
    """A node lost, the survivors recover from memory at step 62, then their own node goes too
    (nobody of that generation reports): the first recovery stays in the books with what the
    coordinator saw, the second is measured as usual. Seen in the goodput bench under load."""
    books = Books(global_batch=8, steps=1000, started_at=0.0)
    books.begin_change("recovery", 19.0, 1, step=62, cause="lost w1, w3", reached=63)
    books.world_size_history.append([62, 2])
    books.generation_stepped(0, 19.2)  # an older generation's note: not this change's
    books.generation_stepped(1, 19.7)
    books.add_generation_results(1, [_dead("w0"), _dead("w2")])
    assert len(books.summary(None)["recoveries"]) == 1  # kept when its generation ends: a job may end there
    books.begin_change("recovery", 64.0, 2, step=None, cause="lost w0, w2; restored from a checkpoint", reached=370)
    books.world_size_history.append([-1, 1])  # the checkpoint's step is known once it is read
    report = _report("w5", 0, [0.1], [0.0], first_step_at=66.0)
    books.add_generation_results(2, [Report(**{**vars(report), "log": ((350, 0, 2800, 8),)})])
    first, second = books.summary(None)["recoveries"]
    assert first == {"step": 62, "cause": "lost w1, w3", "lost_steps": 1, "recomputed_steps": 2, "failed_at": 19.0,
                     "stall_s": None, "to_next_step_done_s": 0.7, "first_step_s": None, "worker_start_s": None,
                     "worker_ready_after_s": None}
    assert second["step"] == 350 and second["lost_steps"] == 20 and second["stall_s"] == 2.0
    assert books.summary(None)["world_size_history"] == [[62, 2], [350, 1]]


def test_a_change_whose_generation_never_stepped_is_replaced_by_the_next_one():
    """A recovery whose generation failed before its first step (a second kill noticed late): the
    next recovery stands for both, as one stall."""
    books = Books(global_batch=8, steps=100, started_at=0.0)
    books.begin_change("recovery", 5.0, 3, step=12, cause="lost w0", reached=12)
    books.add_generation_results(3, [Report(Outcome("w2", "failed", 12), ended_at=5.5)])
    books.begin_change("recovery", 5.6, 4, step=10, cause="lost w1; restored from a checkpoint", reached=12)
    report = _report("w2", 0, [0.1], [0.0], first_step_at=7.0)
    books.add_generation_results(4, [Report(**{**vars(report), "log": ((10, 0, 80, 8),)})])
    (change,) = books.summary(None)["recoveries"]
    assert change["cause"] == "lost w1; restored from a checkpoint" and change["lost_steps"] == 2


def test_the_steps_reached_are_what_members_said_and_unknown_when_nobody_did():
    """Survivors report their step; a lost worker's beat process tells its last one as its process
    ends (a node lost with it says nothing). Seen before: a dead member counted as step 0, so one
    worker killed with 13 steps done and restored from 10 gave 'lost 0, recomputed 1'."""
    from elastic_zero.coordinator.books import steps_reached

    dead = Report(Outcome("w0", "dead"), ended_at=1.0)
    alive = Report(Outcome("w1", "failed", 12), ended_at=1.0)
    assert steps_reached([dead], {"w0": 13}) == 13
    assert steps_reached([dead], {}) is None  # never a guess
    assert steps_reached([dead, alive], {}) == 12
    assert steps_reached([dead, alive], {"w0": 13}) == 13
    books = Books(global_batch=8, steps=16, started_at=0.0)
    books.begin_change("recovery", 12.0, 2, step=None, cause="lost w0", reached=steps_reached([dead], {"w0": 13}))
    books.world_size_history.append([-1, 1])
    books.restored(2, 10)  # rank 0's note: the checkpoint of step 10, before any step was trained again
    assert books.world_size_history[-1] == [10, 1]
    books.add_generation_results(2, [_report("w2", 0, [0.5], [0.0], first_step_at=13.0, step=16)])
    (recovery,) = books.summary(None)["recoveries"]
    assert (recovery["step"], recovery["lost_steps"], recovery["recomputed_steps"]) == (10, 3, 4)


def test_a_lost_members_last_word_heard_after_its_recovery_began_still_counts():
    """A standby started a checkpoint recovery 46 ms after w0 was lost, before its beat process's
    last word (13 steps done) was read: the recovery's lost steps came out unknown. The word, heard
    before the recovery's generation is booked, counts; one of another generation does not."""
    books = Books(global_batch=8, steps=16, started_at=0.0)
    books.begin_change("recovery", 12.0, 2, step=10, cause="lost w0, w1", reached=None, _unheard=(1, ("w0", "w1")))
    assert books.words_awaited() == (1, ("w0", "w1"))
    books.last_words_heard(0, {"w0": 15})  # another generation's: not this failure's
    books.last_words_heard(1, {"w0": 13})
    assert books.words_awaited() == (1, ("w1",))
    books.last_words_heard(1, {"w0": 13, "w1": 12})
    assert books.words_awaited() is None
    books.add_generation_results(2, [_report("w2", 0, [0.5], [0.0], first_step_at=13.0, step=16)])
    (recovery,) = books.summary(None)["recoveries"]
    assert (recovery["lost_steps"], recovery["recomputed_steps"]) == (3, 4) and "_unheard" not in recovery


def test_a_recovery_whose_lost_never_spoke_keeps_what_the_survivors_said():
    """A node that vanished says nothing: the survivors' step stands, never a guess."""
    books = Books(global_batch=8, steps=16, started_at=0.0)
    books.begin_change("recovery", 12.0, 2, step=10, cause="lost w0", reached=12, _unheard=(1, ("w0",)))
    books.last_words_heard(1, {})
    books.add_generation_results(2, [_report("w2", 0, [0.5], [0.0], first_step_at=13.0, step=16)])
    (recovery,) = books.summary(None)["recoveries"]
    assert recovery["lost_steps"] == 2 and "_unheard" not in recovery


def test_a_checkpoints_records_of_the_run_this_job_resumed_from_are_not_this_jobs():
    """A resumed job (its first step 100) restores, after a whole loss, a checkpoint whose manifest
    also holds the earlier run's steps (a generation's records reach back to its start): those are
    not counted; the restored generation's own are."""
    books = Books(global_batch=8, steps=130, started_at=0.0)
    books.samples.add(3, [[(step, 0, step * 8, 8) for step in range(100, 110)]])
    books.add_checkpoint_log([(2, step, 0, step * 8, 8) for step in range(90, 120)])
    summary = books.summary(None)
    assert summary["resumed_from_step"] == 100 and summary["samples_consumed"] == 20 * 8
    assert summary["duplicate_samples"] == 0


def test_a_coordinator_that_takes_over_reads_its_predecessors_worker_starts_and_restores(tmp_path):
    """The workers it adopts said hello to the coordinator before it: their starts come from the
    job's log, so a recovery it closes still names the start it waited for; and a restore its
    predecessor told is not told again without its step."""
    from elastic_zero.coordinator.job_record import JobRecord
    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.observe.event_log import EventLog

    spec_dict = {"name": "taken", "model": {"preset": "gpt-tiny"}, "train": {"steps": 4, "global_batch": 8}}
    earlier = EventLog(str(tmp_path))
    earlier.add("worker_ready", actor_id="w3", node="n", pid=1, node_up_t=None, start_s={"ray": 0.2, "imports": 1.1})
    earlier.add("worker_ready", actor_id="w4", node="n", pid=2, node_up_t=None, start_s={})  # told none
    earlier.add("checkpoint_restored", generation=3, directory="c/step-0000000020", step=20)
    record = JobRecord(spec_from_dict(spec_dict), spec_dict, "taken", str(tmp_path), 0.0, restarted=True)
    assert list(record.books.worker_starts) == ["w3"]
    assert record.books.worker_starts["w3"][1] == {"ray": 0.2, "imports": 1.1}
    # the generation it took over ends naming the checkpoint it restored: told once, by its predecessor
    assert not record.restored(3, "c/step-0000000020", None)
    assert record.restored(4, "c/step-0000000030", None)  # reports before rank 0's note: the name's step
    told = [r for r in record.events.records if r["event"] == "checkpoint_restored"]
    assert [(r["generation"], r["step"]) for r in told] == [(3, 20), (4, 30)]


def test_a_replacement_coordinators_summary_counts_its_predecessors_changes(tmp_path):
    """A change its predecessor measured (change_measured) is in its summary; one its predecessor began
    and did not live to measure (change_begun, of the generation taken over) it measures itself."""
    from elastic_zero.coordinator.job_record import JobRecord
    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.observe.event_log import EventLog

    spec_dict = {"name": "taken", "model": {"preset": "gpt-tiny"}, "train": {"steps": 40, "global_batch": 8}}
    earlier = EventLog(str(tmp_path))
    measured = {"step": 8, "cause": "lost w1", "source": "snapshot", "stall_s": 0.4}
    earlier.add("change_measured", what="recovery", change=measured)
    earlier.add("change_begun", generation=5, pending={"_kind": "reconfiguration", "_since": 100.0, "step": 20,
                                                       "from": 1, "to": 2, "cause": "joined"})
    record = JobRecord(spec_from_dict(spec_dict), spec_dict, "taken", str(tmp_path), 0.0, restarted=True)
    assert record.books.recoveries == [measured] and record.books.reconfigurations == []
    record.change_taken_over(6)  # a generation the predecessor began no change with: nothing pending
    assert record.books.pending_change is None
    record.change_taken_over(5)
    assert record.books.pending_generation == 5
    assert record.books.pending_change == {"_kind": "reconfiguration", "_since": 100.0, "step": 20, "from": 1,
                                           "to": 2, "cause": "joined", "_unheard": None}
    # a recovery from a checkpoint its predecessor planned (its step known once read) is measured from the
    # reports of the generation taken over, whose first step names it (found by the chaos drill; this log
    # holds no generation_start, so the books have no world-size entry to fill in)
    restored = tmp_path / "restored"
    earlier = EventLog(str(restored))
    earlier.add("change_begun", generation=7, pending={"_kind": "recovery", "_since": 9.0, "step": None,
                                                       "cause": "lost w1; restored from a checkpoint", "reached": 33,
                                                       "source": "checkpoint"})
    record = JobRecord(spec_from_dict(spec_dict), spec_dict, "taken", str(restored), 0.0, restarted=True)
    record.change_taken_over(7)
    report = _report("w0", 0, [0.5], [0.0], first_step_at=12.0)
    record.books.add_generation_results(7, [Report(**{**vars(report), "log": ((30, 0, 240, 8),)})])
    (change,) = record.books.recoveries
    assert change["step"] == 30 and change["stall_s"] == 3.0 and change["lost_steps"] == 3, change

    # its predecessor booked generation 5's end (measured its change) and died before the next began: the
    # workers tell generation 5's report again, and its change is not measured twice
    again = tmp_path / "again"
    earlier = EventLog(str(again))
    earlier.add("change_begun", generation=5, pending={"_kind": "recovery", "_since": 100.0, "step": 20,
                                                       "cause": "lost w1", "reached": 21, "source": "snapshot"})
    earlier.add("generation_end", generation=5, outcomes=["safe_point"], ended_at={}, errors={})
    record = JobRecord(spec_from_dict(spec_dict), spec_dict, "taken", str(again), 0.0, restarted=True)
    record.change_taken_over(5)
    assert record.books.pending_change is None


def test_a_coordinator_that_takes_over_books_the_records_its_predecessor_restored_from_a_checkpoint(tmp_path):
    """Seen in the chaos drill (seed 62, stage 1): generation 3 trained steps 63-64 and was lost
    with its reports; generation 4 restored the checkpoint of step 65, whose records of those steps
    were booked; then the coordinator died. Its replacement read only the generations' reports from
    the log: the final summary counted 16 samples skipped that were trained once (the weights
    matched the fault-free run), and its world sizes began at its own first generation. Oracles: the
    predecessor's own books, and the job's status."""
    from elastic_zero.coordinator.job_record import JobRecord
    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.observe.live import world_size_history

    spec_dict = {"name": "taken", "model": {"preset": "gpt-tiny"}, "train": {"steps": 65, "global_batch": 8}}
    spec = spec_from_dict(spec_dict)
    first = JobRecord(spec, spec_dict, "taken", str(tmp_path), 0.0, restarted=False)
    for generation, step, source in ((2, 0, "init"), (3, 63, "snapshot"), (4, -1, "checkpoint")):
        first.log("generation_start", generation=generation, step=step, source=source, checkpoint=None,
                  workers=["w0", "w1"], leaving=[], calls=2)
    first.books.samples.add(2, [[(step, 0, step * 8, 8) for step in range(63)]])
    first.log("generation_end", generation=2, outcomes=["dead"], ended_at={}, errors={},
              samples=[(2, 0, 0, 63, 0, 8, 8)])
    checkpoint_rows = [(3, step, 0, step * 8, 8) for step in (63, 64)]
    first.restore_candidates(4, [("c/step-0000000065", checkpoint_rows)])
    first.restored(4, "c/step-0000000065", 65)
    first.add_checkpoint_logs(4, "c/step-0000000065")
    first.add_checkpoint_logs(4, "c/step-0000000065")  # (its reports name it again: logged once)
    assert first.books.summary(None)["skipped_samples"] == 0
    taken_over = JobRecord(spec, spec_dict, "taken", str(tmp_path), 0.0, restarted=True)
    books = taken_over.books.summary(None)
    assert (books["steps"], books["samples_consumed"], books["skipped_samples"]) == (65, 65 * 8, 0)
    assert sum(1 for r in taken_over.events.records if r["event"] == "checkpoint_samples") == 1
    # and the world sizes of its predecessor's generations, as the job's status shows them
    assert books["world_size_history"] == world_size_history(taken_over.events.records) == [[0, 2], [63, 2], [65, 2]]
    # its own generation resumes the latest checkpoint (its workers gone): a start with no change pending,
    # whose step the restore tells (as generation_starts books and logs it)
    taken_over.books.world_size_history.append([0, 3])
    taken_over.log("generation_start", generation=5, step=0, source="init", resume="latest", checkpoint=None,
                   workers=["w5", "w6", "w7"], leaving=[], calls=3)
    assert taken_over.restored(5, "c/step-0000000065", 65)
    assert taken_over.books.summary(None)["world_size_history"] == [[0, 2], [63, 2], [65, 2], [65, 3]]


def test_a_restore_books_only_the_records_read_for_its_own_generation(tmp_path):
    """Candidates are read for one generation (a checkpoint recovery's, or a restarted coordinator's
    resume of the job's own latest commit): a restore by another (a start over that read another run's
    checkpoint) books nothing of them. The job's first step is its first generation's, as the log
    tells. Oracle: the books' counts."""
    from elastic_zero.coordinator.job_record import JobRecord
    from elastic_zero.job.spec import spec_from_dict

    spec_dict = {"name": "gated", "model": {"preset": "gpt-tiny"}, "train": {"steps": 20, "global_batch": 8}}
    record = JobRecord(spec_from_dict(spec_dict), spec_dict, "gated", str(tmp_path), 0.0, restarted=False)
    assert record.first_step() == 0  # nothing logged yet
    record.log("generation_start", generation=0, step=0, source="init", resume="latest", checkpoint=None,
               workers=["w0"], leaving=[], calls=1)
    record.restored(0, "c/step-0000000012", 12)
    assert record.first_step() == 12  # it resumed another run's checkpoint
    record.restore_candidates(1, [("c/step-0000000015", [(0, step, 0, step * 8, 8) for step in range(12, 15)])])
    record.add_checkpoint_logs(2, "c/step-0000000015")  # another generation's restore: none of them
    assert len(record.books.samples) == 0
    record.add_checkpoint_logs(1, "c/step-0000000015")
    assert len(record.books.samples) == 3
