"""The cluster the goodput schedule is played to (bench/goodput_schedule.py), and its player: a
head without CPUs and named worker nodes of this machine (testing/local_cluster.py), each event
carried out at its time. The runners of every system (goodput.py, goodput_torchft.py) share them.
"""

from __future__ import annotations

import time

from elastic_zero.bench.goodput_schedule import START_NODES, ClusterEvent
from elastic_zero.testing.local_cluster import RayHead, RayNode, drain_node

WORKERS, CPUS_PER_NODE, GLOBAL_BATCH, MICRO_BATCH = 4, 2, 16, 4


class BenchCluster:
    """A head without CPUs (drivers, coordinator, Ray Train's controller) and named worker nodes."""

    def __init__(self) -> None:
        self.head = RayHead(auth=False, num_cpus=0)
        self.nodes: dict[str, RayNode] = {}
        self._started = 0  # a node's index picks its worker ports
        try:
            for name in START_NODES:
                self.add(name)
        except Exception:
            self.stop()
            raise

    def add(self, name: str) -> None:
        self.nodes[name] = RayNode(self.head, f"ez_node_{name}", num_cpus=CPUS_PER_NODE, index=self._started)
        self._started += 1

    def drain(self, name: str, deadline_s: float) -> None:
        drain_node(self.head, self.nodes[name].node_id, deadline_s)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.stop()
        self.head.stop()


def play_to_cluster(event: ClusterEvent, cluster: BenchCluster, stop_job) -> None:
    if event.action == "node_lost":
        cluster.nodes[event.node].freeze()
    elif event.action == "node_back":
        cluster.nodes[event.node].stop()  # gone for good; another machine comes in its place
        cluster.add(event.replaced_by)
    elif event.action == "notice":
        cluster.drain(event.node, event.deadline_s)
    elif event.action == "preempted":
        cluster.nodes[event.node].stop()
    elif event.action == "scale_up":
        cluster.add(event.node)
    elif event.action == "end":
        stop_job()


def run_schedule(schedule, play, ended, origin) -> list:
    """Plays each event (`play(event)`) at its time after `origin()` (the epoch the schedule counts
    from: the launch, or the job's first step once there is one) unless the job `ended()` first;
    returns what was played, when."""
    start = None
    while start is None:
        if ended():
            return []
        start = origin()
        if start is None:
            time.sleep(0.2)
    played = []
    for event in schedule:
        while time.time() < start + event.at_s:
            if ended():
                return played
            time.sleep(0.2)
        began = time.time()
        play(event)
        played.append({"action": event.action, "node": event.replaced_by or event.node,
                       "at_s": round(began - start, 1), "took_s": round(time.time() - began, 1)})
    return played
