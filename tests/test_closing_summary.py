"""A step's closing summary, read a step late (worker/closing_summary.py): what the ranks asked for
in it, read once, on the CPU. Pure: the all-reduce is two ranks' summaries summed."""

from elastic_zero.losses import step_summary
from elastic_zero.worker.closing_summary import ClosingSummary


def _summed(asked=(False, False), checkpoint=(False, False), busy=(False, False)):
    parts = [step_summary(a, 2.0, 3.0, {"acc": 1.0}, "cpu", c, save_busy=b) for a, c, b in zip(asked, checkpoint, busy)]
    return parts[0] + parts[1]


def test_what_one_rank_asked_for_every_rank_reads_in_the_summary():
    quiet = ClosingSummary.after_all_reduce(_summed(), 7, ["acc"], True, 6, first=False)
    assert quiet.known_complete() and not quiet.read  # the CPU's all-reduce was done when it was made
    assert not (quiet.safe_point_asked or quiet.checkpoint_asked or quiet.save_busy) and quiet.read
    for field, kwargs in (("safe_point_asked", {"asked": (False, True)}),
                          ("checkpoint_asked", {"checkpoint": (True, False)}),
                          ("save_busy", {"busy": (False, True)})):
        summary = ClosingSummary.after_all_reduce(_summed(**kwargs), 7, ["acc"], True, 6, first=False)
        flags = {f: getattr(summary, f) for f in ("safe_point_asked", "checkpoint_asked", "save_busy")}
        assert flags == {f: f == field for f in flags}, (field, flags)


def test_a_summary_is_read_from_the_device_once():
    reduced = _summed()
    summary = ClosingSummary.after_all_reduce(reduced, 3, ["acc"], False, None, first=True)
    first = summary.values()
    reduced.zero_()  # the device's tensor is the next step's business once read
    assert summary.values() == first and first[1] == 4.0 and first[2] == 6.0


def test_the_batch_totals_travel_with_the_summary_and_are_checked_when_read():
    from elastic_zero.losses import batch_totals, check_batch_totals

    totals = batch_totals([2.0, 3.0], [{"sample_weight": 1}, {"sample_weight": 1}], "cpu") + \
        batch_totals([0.0], [{}], "cpu")  # two ranks, summed: one micro batch without weights
    summary = ClosingSummary.after_all_reduce(_summed(), 4, ["acc"], True, 3, first=False, totals=totals)
    assert summary.total_values() == [5.0, 2.0, 3.0] and summary.values()[1:3] == [4.0, 6.0]
    try:
        check_batch_totals(summary.total_values(), summary.step)
    except ValueError as exc:
        assert str(exc) == "data.collate: 2 of the step's 3 micro batches have a 'sample_weight': give it always or never"
    else:
        raise AssertionError("mixed weights passed")


def test_a_failed_generation_keeps_the_records_of_a_step_that_adds_up_and_not_of_one_that_does_not():
    """salvage(): without replicas a step's sample records are kept once its all-reduce is known to
    have completed (the CPU's); a step whose batch weights summed to 0 is none to keep, and its loss
    (0 / 0) is never computed."""
    from types import SimpleNamespace

    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.losses import batch_totals
    from elastic_zero.worker.cadence_meter import CadenceMeter
    from elastic_zero.worker.checkpoint_records import CheckpointRecords
    from elastic_zero.worker.closing_summary import SummaryReader
    from elastic_zero.worker.commits import StepCommits
    from elastic_zero.worker.pinned_layouts import PinnedLayouts
    from elastic_zero.worker.replica import LayoutReplicas
    from elastic_zero.worker.replication import Replicator

    spec = spec_from_dict({"name": "s", "model": {"preset": "gpt-tiny"}, "elastic": {"replicate_every": 0}})
    replicas, records = LayoutReplicas(), CheckpointRecords()
    commits = StepCommits(spec, CadenceMeter(0), Replicator(), replicas, records, None, "cpu")
    reader = SummaryReader(replicas, PinnedLayouts(lambda: None), commits, None, None, True, lambda: False)
    plan = SimpleNamespace(number=3)  # one rank: no ward to name
    for weights, kept in (([0.0], False), ([4.0], True)):
        report = {"log": [], "ward_log": [], "uncommitted": [(7, 0, 56, 4)], "losses": []}
        reduced = step_summary(False, weights[0], 2.0 * weights[0], {}, "cpu")
        totals = batch_totals(weights, [{"sample_weight": 1}], "cpu")
        reader.salvage(plan, 0, 1, ClosingSummary.after_all_reduce(reduced, 7, [], True, None, False, totals), report)
        assert (report["log"], report["losses"]) == (([(7, 0, 56, 4)], [(7, 2.0)]) if kept else ([], [])), weights
