"""A Ray cluster on this machine whose worker nodes Ray's own autoscaler starts and stops.

The head (local_cluster.RayHead) runs Ray's autoscaler with its fake multi-node provider
(`ray.autoscaler._private.fake_multi_node`): for a pending demand the autoscaler asks the provider
for a node of a fitting type, and the provider starts a raylet of that type's resources and labels
in the autoscaler's own process; an idle node is stopped after the config's idle timeout. The
config is deploy/local-autoscaler/cluster.yaml, the tested stand-in for the deploy recipes.

What the installed Ray (2.60) lacks, worked around here rather than in Ray:
- the provider dials the machine's own address at port 6379 unless `provider.gcs_address` names
  the head: filled in from the head's port;
- `ray.cluster_utils.AutoscalingCluster` runs `ray stop --force` (every Ray of the machine) and
  reads an example.yaml the wheel does not ship: not used;
- a node the provider started is a raylet whose parent is the autoscaler's monitor; a spot reclaim
  is SIGKILL to that raylet and everything below it (`reclaim`), which the provider does not know
  of (it still lists the node until the autoscaler finds it dead and terminates it).
"""

from __future__ import annotations

import os
import signal

import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

from elastic_zero.testing.local_cluster import RayHead, descendants, processes_naming

FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
CONFIG_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "deploy", "local-autoscaler", "cluster.yaml")


def load_config(path: str = CONFIG_PATH) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the autoscaled test cluster's config is missing (a checkout of the "
                                f"repository has it under deploy/local-autoscaler/)")
    with open(path) as fh:
        return yaml.safe_load(fh)


class AutoscaledCluster:
    """A head that trains nothing, and the spot nodes the autoscaler adds for pending workers."""

    def __init__(self, auth: bool = False, config: dict | None = None, v2: bool = True) -> None:
        """`v2`: Ray's autoscaler v2 (KubeRay's default), which packs a demand's label selector;
        v1 (the cluster launcher's default in 2.60) packs resources only, and takes a worker that
        asks for a label the head lacks as fitting on the head."""
        config = config if config is not None else load_config()
        env = {}
        if v2:  # as ray.cluster_utils.AutoscalingCluster(autoscaler_v2=True) sets it up
            # v2 fills the config out from the provider type's example.yaml, which the wheel lacks
            # for fake_multinode: the same provider class, named as an external one, takes Ray's
            # minimal defaults instead
            config = {**config, "provider": {**config["provider"], "type": "external", "module": FAKE_PROVIDER,
                                             "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID}}
            env = {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                   "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID}
        # Ray's autoscaler loop every second (its own setting; 5 s by default): a pending worker's node is
        # asked for, and an idle node given back, seconds sooner (tests/test_autoscaler.py: 79 -> 56 s)
        env["AUTOSCALER_UPDATE_INTERVAL_S"] = "1"
        self.config = config
        head_type = config["available_node_types"][config["head_node_type"]]
        self.head = RayHead(auth=auth, num_cpus=int(head_type["resources"].get("CPU", 0)), env=env,
                            autoscaling_config=config)

    def worker_nodes(self) -> list[dict]:
        """The alive nodes the autoscaler started (the state API's records: node_id, start_time_ms, labels)."""
        return [n for n in self.head.alive_nodes() if not n.get("is_head_node")]

    def node_processes(self, node_id: str) -> list[int]:
        """A node's raylet and every process below it (its workers, its agents)."""
        raylets = [pid for pid in processes_naming(f"--node_id={node_id}") if _is_raylet(pid)]
        return raylets + [child for pid in raylets for child in descendants(pid)]

    def reclaim(self, node_id: str) -> int:
        """The node is gone without a notice, as a spot reclaim: SIGKILL to its processes. Returns how
        many there were (0: no such node here)."""
        pids = self.node_processes(node_id)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self, keep_dir: bool = False) -> None:
        self.head.stop(keep_dir)


def _is_raylet(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return os.path.basename(fh.read().split(b"\0", 1)[0]) == b"raylet"
    except OSError:
        return False
