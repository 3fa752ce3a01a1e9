"""`bench goodput --autoscaler`: the goodput schedule of an autoscaled cluster
(goodput_schedule.autoscaled_schedule) played to a cluster whose spot nodes Ray's autoscaler starts
and stops (autoscaled_cluster.py, deploy/local-autoscaler/cluster.yaml: nodes of one CPU, one
worker each). Nothing is added by hand: each system's workers ask for nodes labelled spot, and the
autoscaler starts one for every worker that waits."""

from __future__ import annotations

import time

from elastic_zero.testing.autoscaled_cluster import AutoscaledCluster, load_config
from elastic_zero.testing.local_cluster import drain_node

WORKERS_AUTOSCALED = 3  # one a node of one CPU: three nodes and a replacement on two cores


def spot_labels() -> dict:
    """The labels of the config's worker node type, which both systems' workers ask for."""
    config = load_config()
    (spot,) = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    return dict(spot["labels"])


class AutoscaledPlayer:
    """Plays a schedule's events to an AutoscaledCluster. A node is named by its place ("first":
    the oldest node not picked yet) when its first event is played, and keeps that name."""

    def __init__(self, cluster: AutoscaledCluster, stop_job) -> None:
        self.cluster, self.stop_job = cluster, stop_job
        self.picked: dict[str, str] = {}  # name in the schedule -> the autoscaler's node id

    def __call__(self, event) -> None:
        if event.action == "end":
            self.stop_job()
            return
        node_id = self.picked.get(event.node) or self._pick(event.node)
        if event.action == "notice":
            drain_node(self.cluster.head, node_id, event.deadline_s)
        elif event.action == "reclaim":
            self.cluster.reclaim(node_id)
        else:
            raise ValueError(f"an autoscaled schedule has no action {event.action!r}")

    def _pick(self, name: str, wait_s: float = 120.0) -> str:
        """The oldest node not picked yet; while there is none (the autoscaler still starting the
        nodes: a schedule counted from the launch), waits for one, up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            nodes = sorted(self.cluster.worker_nodes(), key=lambda n: n.get("start_time_ms") or 0)
            free = [n["node_id"] for n in nodes if n["node_id"] not in self.picked.values()]
            if free:
                self.picked[name] = free[0]
                return free[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no node of the autoscaler's to play {name!r} to after {wait_s:.0f} s")
            time.sleep(1.0)
