"""The goodput bench's schedule (bench/goodput.py) played to torchft's replica groups: a node is its
groups' processes, frozen or killed together; a new node starts groups in its free slots; a group
that crashes is started again, as torchrun would for torchft's torchx component."""

from __future__ import annotations

import os
import time

from elastic_zero.bench.goodput_cluster import CPUS_PER_NODE, GLOBAL_BATCH, MICRO_BATCH, WORKERS, run_schedule
from elastic_zero.bench.goodput_schedule import START_NODES, ClusterEvent, torchft_figures

MAX_RESTARTS = 10  # a torchft group's, as torchft's torchx component passes to torchrun


def play_to_torchft(preset: str, schedule, checkpoint_every: int, work_dir: str, clock: str, stock_ddp_hook: bool) -> dict:
    """torchft's replica groups (bench/torchft_job.py), two to a node as our workers are, each group
    a slot (a share of the global batch). A frozen node's groups are stopped (SIGSTOP), a node that is
    gone has its groups killed, a new node starts groups in the free slots. torchft has no preemption
    notice: the drain goes unseen and the node is killed at its deadline. It writes no checkpoint:
    its examples heal from live peers, and no event here takes every group at once
    (`checkpoint_every` does not apply). `stock_ddp_hook`: torchft's own DDP comm hook, which ends a
    group whose all-reduce fails (see `_ddp` in bench/torchft_job.py)."""
    from elastic_zero.bench.torchft_cluster import TorchftCluster, supervise

    stop_file = os.path.join(work_dir, "stop_at")
    config = {"preset": preset, "steps": 10 ** 9, "micro_batch": MICRO_BATCH, "global_batch": GLOBAL_BATCH,
              "stop_file": stop_file, "stock_ddp_hook": stock_ddp_hook}
    nodes: dict[str, list[int]] = {}
    played: list = []
    crashes: list[int] = []  # the slot of each group that exited with an error and was started again
    launched_at = time.time()
    with TorchftCluster(config, WORKERS, work_dir) as cluster:
        def add(node: str) -> None:
            taken = {slot for slots in nodes.values() for slot in slots}
            nodes[node] = [slot for slot in range(WORKERS) if slot not in taken][:CPUS_PER_NODE]
            for slot in nodes[node]:
                cluster.start(slot)

        def gone(node: str) -> None:
            for slot in nodes.pop(node):
                cluster.kill(slot)

        def stop_job() -> None:
            # a step every group reaches: a group may be a step past the last one logged
            last = max((r["step"] for r in cluster.records() if r["committed"]), default=0)
            with open(stop_file + ".tmp", "w") as fh:
                fh.write(str(last + 3))
            os.replace(stop_file + ".tmp", stop_file)

        def play(event: ClusterEvent) -> None:
            if event.action == "node_lost":
                for slot in nodes[event.node]:
                    cluster.freeze(slot)
            elif event.action == "node_back":
                gone(event.node)
                add(event.replaced_by)
            elif event.action == "preempted":
                gone(event.node)
            elif event.action == "scale_up":
                add(event.node)
            elif event.action == "end":
                stop_job()
            # "notice": nothing in torchft listens for one

        def restarted(slot: int, code: int) -> bool:
            """A group that crashed is started again, as torchrun does for torchft's torchx component
            (`--max_restarts=10`): torchft's DDP hook fails the process when an all-reduce times out."""
            if crashes.count(slot) >= MAX_RESTARTS:
                return False
            crashes.append(slot)
            cluster.start(slot)
            return True

        def ended() -> bool:
            """Whether every group has finished; a group that failed is started again (or it is an error)."""
            for slot, code in cluster.wait_exits(0).items():
                if code != 0 and not restarted(slot, code):
                    raise cluster.failed(slot, code)
            return not cluster.procs

        def first_step() -> float | None:
            return min((r["done"] for r in cluster.records() if r["committed"]), default=None)

        try:
            for node in START_NODES:
                add(node)
            played = run_schedule(schedule, play, ended, (lambda: launched_at) if clock == "launch" else first_step)
            supervise(cluster, lambda: not cluster.procs, 300, "stop", restarted)
        except RuntimeError as e:  # a group or the lighthouse failed: named in the report
            return {"rc": 1, "error": str(e), "wall_s": round(time.time() - launched_at, 1), "played": played}
        wall = time.time() - launched_at
        records = cluster.records()
    return {"rc": 0, "error": None, "wall_s": round(wall, 1), "played": played, "groups_started": cluster.started,
            "ddp_hook": "stock" if stock_ddp_hook else "error-tolerant",
            **torchft_figures(records, GLOBAL_BATCH, launched_at, wall, restarts=len(crashes))}
