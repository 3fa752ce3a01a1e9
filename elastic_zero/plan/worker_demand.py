"""What a worker asks of a node, and whether the cluster's autoscaler says no node type offers it.

A pending worker is a demand: its resource bundle (one CPU or one GPU, and the job's
`elastic.worker_resources`) and its label selector (`elastic.worker_labels`). Ray's autoscaler v2
lists the demands that no node type of its config can hold as infeasible; such a worker would
wait for ever, so the job fails with a line naming what it asked for. Pure: the autoscaler's list
comes in as an argument (coordinator/autoscaler_view.py reads it).
"""

from __future__ import annotations

# a label constraint as the autoscaler reports it: (operator, values); "in" is what worker_labels asks
Constraint = tuple[str, tuple[str, ...]]


def worker_bundle(use_gpu: bool, worker_resources: dict) -> dict[str, float]:
    """The resources one worker asks Ray for (coordinator/spawner.py asks the same)."""
    return {("GPU" if use_gpu else "CPU"): 1.0, **{k: float(v) for k, v in worker_resources.items()}}


def unplaceable(bundle: dict[str, float], labels: dict[str, str],
                infeasible: list[tuple[dict[str, float], dict[str, Constraint]]]) -> str | None:
    """Why a worker asking `bundle` on nodes with `labels` can never start (one line naming the
    spec's fields), when one of the autoscaler's `infeasible` requests is this worker's; else None.
    A request is this worker's when it asks the same resources and at least the job's labels (a
    replacement's selector also keeps it off the nodes that go)."""
    for resources, constraints in infeasible:
        if not _same_resources(resources, bundle):
            continue
        if any(constraints.get(key) is None or constraints[key][0] != "in" or value not in constraints[key][1]
               for key, value in labels.items()):
            continue
        return _reason(bundle, labels)
    return None


def _same_resources(a: dict[str, float], b: dict[str, float]) -> bool:
    keys = {k for k, v in a.items() if v} | {k for k, v in b.items() if v}
    return all(abs(a.get(k, 0.0) - b.get(k, 0.0)) < 1e-9 for k in keys)


def _reason(bundle: dict[str, float], labels: dict[str, str]) -> str:
    device = "GPU" if "GPU" in bundle else "CPU"
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    fields = ", ".join(filter(None, ("elastic.worker_resources" if custom else "",
                                     "elastic.worker_labels" if labels else ""))) or "elastic.use_gpu"
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(bundle.items()))
    on = f" on a node labelled {', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}" if labels else ""
    return (f"{fields}: no node type of the cluster's autoscaler offers a worker's {wanted}{on} "
            f"(one {device} a worker; Ray's autoscaler calls the request infeasible)")
