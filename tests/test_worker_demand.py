"""A worker no node type can host is found from the autoscaler's infeasible requests
(plan/worker_demand.py). Oracle: requests written as Ray's autoscaler v2 reports them (seen on the
autoscaled test cluster: a label no node type has, a resource none offers, more CPUs than a node)."""

from elastic_zero.plan.worker_demand import unplaceable, worker_bundle

SPOT = {"ray.io/market-type": "spot"}


def test_the_bundle_is_one_cpu_or_one_gpu_and_the_jobs_resources():
    assert worker_bundle(False, {}) == {"CPU": 1.0}
    assert worker_bundle(True, {"spot": 1}) == {"GPU": 1.0, "spot": 1.0}


def test_the_workers_own_request_is_found_and_named_by_the_fields_it_came_from():
    infeasible = [({"CPU": 4.0}, {}), ({"CPU": 1.0, "gpu_x": 1.0}, {})]
    reason = unplaceable(worker_bundle(False, {"gpu_x": 1}), {}, infeasible)
    assert reason.startswith("elastic.worker_resources: no node type of the cluster's autoscaler offers a "
                             "worker's CPU 1, gpu_x 1"), reason
    labelled = [({"CPU": 1.0}, {"ray.io/market-type": ("in", ("ondemand",))})]
    assert unplaceable({"CPU": 1.0}, {"ray.io/market-type": "ondemand"}, labelled).startswith(
        "elastic.worker_labels: no node type")
    assert "on a node labelled ray.io/market-type=ondemand" in unplaceable(
        {"CPU": 1.0}, {"ray.io/market-type": "ondemand"}, labelled)
    assert unplaceable({"GPU": 1.0}, {}, [({"GPU": 1.0}, {})]).startswith("elastic.use_gpu: ")


def test_a_replacement_kept_off_the_nodes_that_go_is_still_the_workers_request():
    avoid = {"ray.io/node-id": ("not_in", ("abc",)), "ray.io/market-type": ("in", ("spot",))}
    assert unplaceable({"CPU": 1.0}, SPOT, [({"CPU": 1.0}, avoid)]) is not None


def test_another_tasks_request_is_not_the_workers():
    assert unplaceable({"CPU": 1.0}, SPOT, [({"CPU": 2.0}, {})]) is None  # other resources
    assert unplaceable({"CPU": 1.0}, SPOT, [({"CPU": 1.0}, {})]) is None  # asks no label: not a worker of this job
    assert unplaceable({"CPU": 1.0}, SPOT, [({"CPU": 1.0}, {"ray.io/market-type": ("in", ("gpu",))})]) is None
    assert unplaceable({"CPU": 1.0}, {}, []) is None
