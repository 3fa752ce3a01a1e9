"""What a worker asks of a node, and whether the cluster's autoscaler can never give it.

A pending worker is a demand: its resource bundle (one CPU or one GPU, and the job's
`elastic.worker_resources`) and its label selector (`elastic.worker_labels`). Ray's autoscaler v2
lists the demands it cannot place as infeasible, but that list mixes two things: no node type
offers the demand (it would wait for ever), and the node type that offers it is at its
`max_workers` for now (a reclaimed node still counted, say: it clears). The second always has
nodes of that type in the cluster, so a demand is judged unplaceable only when the autoscaler lists
it and no node of the cluster, alive or not, offers it. Pure: the autoscaler's view comes in as
arguments (coordinator/autoscaler_view.py reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

NODE_ID_LABEL = "ray.io/node-id"  # a replacement's selector keeps it off the nodes that go: not the job's ask


@dataclass(frozen=True)
class AutoscalerView:
    """The autoscaler's infeasible requests: (resources, {label: (operator, values)}); the nodes it
    knows of, alive or dead: (total resources, labels)."""

    infeasible: tuple = ()
    nodes: tuple = ()


def worker_bundle(use_gpu: bool, worker_resources: dict) -> dict[str, float]:
    """The resources one worker asks Ray for (coordinator/worker_pool.py asks the same)."""
    return {("GPU" if use_gpu else "CPU"): 1.0, **{k: float(v) for k, v in worker_resources.items()}}


def unplaceable(bundle: dict[str, float], labels: dict[str, str], view: AutoscalerView) -> str | None:
    """Why a worker asking `bundle` on nodes with `labels` can never start (one line naming the
    spec's fields), or None: the autoscaler lists this very request (the same resources and exactly
    the job's labels, a node-id exclusion aside) and no node it knows offers it."""
    if not any(_same_resources(resources, bundle) and _asks_exactly(constraints, labels)
               for resources, constraints in view.infeasible):
        return None
    if any(_offers(total, node_labels, bundle, labels) for total, node_labels in view.nodes):
        return None  # its node type exists: the autoscaler is at a limit for now, not without a type
    return _reason(bundle, labels)


def _same_resources(a: dict[str, float], b: dict[str, float]) -> bool:
    keys = {k for k, v in a.items() if v} | {k for k, v in b.items() if v}
    return all(abs(a.get(k, 0.0) - b.get(k, 0.0)) < 1e-9 for k in keys)


def _asks_exactly(constraints: dict, labels: dict[str, str]) -> bool:
    asked = {k: c for k, c in constraints.items() if k != NODE_ID_LABEL}
    return asked == {k: ("in", (v,)) for k, v in labels.items()}


def _offers(total: dict[str, float], node_labels: dict[str, str], bundle: dict[str, float],
            labels: dict[str, str]) -> bool:
    return all(total.get(k, 0.0) >= v for k, v in bundle.items()) and \
        all(node_labels.get(k) == v for k, v in labels.items())


def _reason(bundle: dict[str, float], labels: dict[str, str]) -> str:
    device = "GPU" if "GPU" in bundle else "CPU"
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    fields = ", ".join(filter(None, ("elastic.worker_resources" if custom else "",
                                     "elastic.worker_labels" if labels else ""))) or "elastic.use_gpu"
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(bundle.items()))
    on = f" on a node labelled {', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}" if labels else ""
    return (f"{fields}: no node type of the cluster's autoscaler offers a worker's {wanted}{on} "
            f"(one {device} a worker; Ray's autoscaler calls the request infeasible, and no node has it)")
