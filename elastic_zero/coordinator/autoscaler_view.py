"""What the cluster's autoscaler says it cannot place, and the nodes it knows: read from the GCS's
cluster status (plan/worker_demand.py judges them). Ray 2.60 has no public call for the infeasible
requests: the reply is read through Ray's own client, and any failure (no autoscaler, v1, an older
Ray) reads as an empty view ("nothing said")."""

from __future__ import annotations

from elastic_zero.plan.worker_demand import AutoscalerView

OPERATORS = {1: "in", 2: "not_in"}  # LabelSelectorOperator: LABEL_OPERATOR_IN, LABEL_OPERATOR_NOT_IN


def autoscaler_view(timeout_s: int = 5) -> AutoscalerView:
    """The view of the autoscaler of the cluster this process is connected to."""
    try:
        import ray
        from ray._raylet import GcsClient
        from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

        reply = GetClusterStatusReply()
        reply.ParseFromString(GcsClient(ray.get_runtime_context().gcs_address).get_cluster_status(timeout_s=timeout_s))
    except Exception:  # noqa: BLE001 - no answer is no verdict: the job waits as before
        return AutoscalerView()
    infeasible = []
    for request in reply.autoscaling_state.infeasible_resource_requests:
        constraints = {}
        for selector in request.label_selectors:
            for c in selector.label_constraints:
                constraints[c.label_key] = (OPERATORS.get(c.operator, str(c.operator)), tuple(c.label_values))
        infeasible.append((dict(request.resources_bundle), constraints))
    nodes = [(dict(n.total_resources), dict(n.labels)) for n in reply.cluster_resource_state.node_states]
    return AutoscalerView(tuple(infeasible), tuple(nodes))
