"""A rank's replicas by layout: the layout a generation was built from stays until dropped. Pure."""

from elastic_zero.worker.replica import LayoutReplicas


def test_the_first_commit_in_a_layout_keeps_the_one_it_was_built_from():
    r = LayoutReplicas()
    own0, ward0, own1, ward1 = object(), object(), object(), object()  # stand-ins for shard snapshots
    r.add(0, None, 4, own0, ward0)
    r.add(0, None, 5, own0, ward0)
    assert r.of(0).own == {4: own0, 5: own0} and r.earlier is None
    r.add(2, 0, 6, own1, ward1)  # generation 2, built from generation 0's layout
    assert r.of(2).own == {6: own1} and r.of(0).ward == {4: ward0, 5: ward0} and r.of(1) is None
    assert r.report() == {"own_steps": (6,), "ward_steps": (6,), "snapshot_generation": 2,
                          "earlier": (0, (4, 5), (4, 5))}
    r.add(3, 1, 7, own1, None)  # built from a layout this rank never held: nothing earlier to keep
    assert r.earlier is None and r.of(3).ward == {}
    r.add(4, 3, 8, own1, ward1)
    r.confirmed()
    assert r.of(3) is None and r.report()["earlier"] == ()


def test_a_confirmed_step_lets_the_older_ones_go():
    """At rest a rank holds one step (its own and its ward's snapshot); the previous step stays only
    until every rank is known to hold the newer one."""
    r = LayoutReplicas()
    r.add(0, None, 4, "own4", "ward4")
    r.add(0, None, 5, "own5", "ward5")  # committed here, not yet known everywhere: 4 may still be the one
    assert r.report()["own_steps"] == (4, 5) and r.report()["ward_steps"] == (4, 5)
    r.confirmed()
    assert r.of(0).own == {5: "own5"} and r.of(0).ward == {5: "ward5"}
    r.add(0, None, 6, "own6", None)  # alone: no ward
    r.confirmed()
    assert r.report()["own_steps"] == (6,) and r.report()["ward_steps"] == (5,)


def test_a_handover_keeps_only_the_step_it_restores():
    """A safe point (or a recovery) restores one step: the others of that layout go before the handover."""
    r = LayoutReplicas()
    r.add(0, None, 4, "own4", "ward4")
    r.add(0, None, 6, "own6", "ward6")  # the safe point's commit, not confirmed by an all-reduce after it
    r.of(0).keep_only(6)
    assert r.report()["own_steps"] == (6,) and r.report()["ward_steps"] == (6,)
    r.of(0).keep_only(4)  # a step it does not hold: nothing is left to restore from
    assert r.report()["own_steps"] == () and r.report()["ward_steps"] == ()


def test_a_step_confirmed_late_keeps_the_commits_made_after_it():
    """A step's closing all-reduce is read a step late (worker/closing_summary.py): by then this rank
    may have committed a newer step, which its peers may not hold yet. Confirming the step the
    all-reduce witnessed lets only the older ones go."""
    r = LayoutReplicas()
    r.add(0, None, 4, "own4", "ward4")
    r.add(0, None, 5, "own5", "ward5")  # witnessed by the all-reduce being read
    r.add(0, None, 6, "own6", "ward6")  # committed since: not known everywhere
    r.confirmed(5)
    assert r.report()["own_steps"] == (5, 6) and r.report()["ward_steps"] == (5, 6)
    r.confirmed(6)
    assert r.of(0).own == {6: "own6"} and r.of(0).ward == {6: "ward6"}
