"""A worker no node type can host is found from the autoscaler's view (plan/worker_demand.py,
coordinator/placement_watch.py). Oracle: requests written as Ray's autoscaler v2 reports them
(seen on the autoscaled test cluster: a label no node type has, a resource none offers, more CPUs
than a node has), and the nodes it reports."""

import threading
import time

from elastic_zero.coordinator.placement_watch import VERDICT_HOLD_S, PlacementWatch
from elastic_zero.plan.worker_demand import AutoscalerView, unplaceable, worker_bundle

SPOT = {"ray.io/market-type": "spot"}
SPOT_NODE = ({"CPU": 1.0, "memory": 1e9}, {"ray.io/market-type": "spot", "ray.io/node-id": "n1"})
HEAD = ({"CPU": 1.0}, {"ray.io/node-id": "n0"})


def test_the_bundle_is_one_cpu_or_one_gpu_and_the_jobs_resources():
    assert worker_bundle(False, {}) == {"CPU": 1.0}
    assert worker_bundle(True, {"spot": 1}) == {"GPU": 1.0, "spot": 1.0}


def test_the_workers_own_request_that_no_node_offers_is_named_by_the_fields_it_came_from():
    view = AutoscalerView(infeasible=(({"CPU": 4.0}, {}), ({"CPU": 1.0, "gpu_x": 1.0}, {})), nodes=(HEAD, SPOT_NODE))
    reason = unplaceable(worker_bundle(False, {"gpu_x": 1}), {}, view)
    assert reason.startswith("elastic.worker_resources: no node type of the cluster's autoscaler offers a "
                             "worker's CPU 1, gpu_x 1"), reason
    labelled = AutoscalerView(infeasible=(({"CPU": 1.0}, {"ray.io/market-type": ("in", ("ondemand",))}),),
                              nodes=(HEAD, SPOT_NODE))
    reason = unplaceable({"CPU": 1.0}, {"ray.io/market-type": "ondemand"}, labelled)
    assert reason.startswith("elastic.worker_labels: no node type") and "labelled ray.io/market-type=ondemand" in reason
    assert unplaceable({"GPU": 1.0}, {}, AutoscalerView((({"GPU": 1.0}, {}),), (HEAD,))).startswith("elastic.use_gpu: ")


def test_a_replacement_kept_off_the_nodes_that_go_is_still_the_workers_request():
    avoid = {"ray.io/node-id": ("not_in", ("abc",)), "ray.io/market-type": ("in", ("a100",))}
    assert unplaceable({"CPU": 1.0}, {"ray.io/market-type": "a100"}, AutoscalerView((({"CPU": 1.0}, avoid),), (HEAD,)))


def test_a_node_type_at_its_limit_is_no_verdict_its_nodes_offer_the_request():
    # a spot node reclaimed and still counted: the autoscaler lists the replacement as infeasible for now
    replacement = ({"CPU": 1.0}, {"ray.io/node-id": ("not_in", ("n2",)), "ray.io/market-type": ("in", ("spot",))})
    assert unplaceable({"CPU": 1.0}, SPOT, AutoscalerView((replacement,), (HEAD, SPOT_NODE))) is None


def test_another_tasks_request_is_not_the_workers():
    nodes = (HEAD,)
    assert unplaceable({"CPU": 1.0}, SPOT, AutoscalerView((({"CPU": 2.0}, {}),), nodes)) is None  # other resources
    assert unplaceable({"CPU": 1.0}, SPOT, AutoscalerView((({"CPU": 1.0}, {}),), nodes)) is None  # no label
    other_label = ({"CPU": 1.0}, {"ray.io/market-type": ("in", ("gpu",))})
    assert unplaceable({"CPU": 1.0}, SPOT, AutoscalerView((other_label,), nodes)) is None
    # a job without labels: another's request that asks a label is not its own
    assert unplaceable({"CPU": 1.0}, {}, AutoscalerView((other_label,), nodes)) is None
    assert unplaceable({"CPU": 1.0}, {}, AutoscalerView()) is None


def test_a_read_begun_before_a_reset_says_nothing_after_it():
    """The autoscaler's answer to a read made while other workers were starting, arriving after
    reset() (no worker starting), is not a verdict on the workers that start later: CI saw it held
    as one when the test below reset while its second read was in flight."""
    release, started = threading.Event(), threading.Event()

    def slow_reader():
        started.set()
        release.wait(10)
        return AutoscalerView((({"CPU": 1.0, "a100": 1.0}, {}),), (HEAD,))

    watch = PlacementWatch({"CPU": 1.0, "a100": 1.0}, {}, read=slow_reader)
    now = time.monotonic()
    assert watch.look(now) is None and started.wait(10)
    watch.reset()
    release.set()
    deadline = time.monotonic() + 10
    while watch._reading:  # the read in flight ends (its answer discarded)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert watch.look(now + 1) is None  # (a new read starts no sooner than LOOK_S after the first)
    assert watch._reason is None


def test_a_verdict_is_acted_on_once_it_has_held_and_a_read_that_clears_it_starts_over():
    views = [AutoscalerView((({"CPU": 1.0, "a100": 1.0}, {}),), (HEAD,))]
    read = threading.Event()

    def reader():
        read.set()
        return views[0]

    watch = PlacementWatch({"CPU": 1.0, "a100": 1.0}, {}, read=reader)
    now = time.monotonic()
    assert watch.look(now) is None  # the first read, in the background
    assert read.wait(10)
    deadline = time.monotonic() + 10
    while watch.look(now + VERDICT_HOLD_S + 5) is None:  # once the read is in, it holds that long later
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "no node type" in watch.look(now + VERDICT_HOLD_S + 5)
    assert watch.look(now + 1) is None  # not yet held long enough at that time
    watch.reset()
    assert watch.look(now + VERDICT_HOLD_S + 5) is None
