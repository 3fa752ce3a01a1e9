"""`elastic-zero run`: start (or join) a Ray cluster, run the job's coordinator, write the outputs."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from elastic_zero.spec import JobSpec

EXIT_OK, EXIT_FAILED, EXIT_BAD_SPEC = 0, 1, 2


def run_job(spec: JobSpec, run_dir: str, address: str | None = None, final_weights: str | None = None,
            started_at: float | None = None) -> int:
    started_at = started_at or time.time()
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, Coordinator, coordinator_name

    os.makedirs(run_dir, exist_ok=True)
    own_ray = not ray.is_initialized()
    if own_ray:
        if address:
            ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR")
        else:  # an embedded local Ray: logical CPUs for every worker the job may have
            cpus = max(os.cpu_count() or 1, spec.elastic.max_workers + 1)
            ray.init(num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False, logging_level="ERROR")
    try:
        actor = ray.remote(Coordinator).options(
            name=coordinator_name(spec.name), namespace=NAMESPACE, num_cpus=0, max_concurrency=16,
        ).remote(spec.to_dict(), started_at)
        result = ray.get(actor.run.remote())
        ray.kill(actor)
    finally:
        if own_ray:
            ray.shutdown()
    with open(os.path.join(run_dir, "events.jsonl"), "w") as fh:
        for record in result["events"]:
            fh.write(json.dumps(record) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump({**result["summary"], "ok": result["ok"], "error": result.get("error")}, fh, indent=1)
    if not result["ok"]:
        print(f"elastic-zero: training failed: {result['error']}", file=sys.stderr)
        return EXIT_FAILED
    if final_weights:
        torch.save(result["final_state"], final_weights)
    s = result["summary"]
    print(f"done: {s['steps']} steps, final loss {s['final_loss']:.4f}, world sizes "
          f"{' -> '.join(str(n) for _, n in s['world_size_history'])}, {len(s['recoveries'])} recoveries, "
          f"{len(s['reconfigurations'])} reconfigurations; outputs in {run_dir}")
    return EXIT_OK
