"""Jobs on a real local Ray for the runtime tests: run one, read its outputs, compare weights."""

import json

import torch

from elastic_zero.api import RunConfig, run_job
from elastic_zero.job.spec import spec_from_dict


def job_spec(name, faults=(), **sections):
    """The runtime tests' job: gpt-tiny (300 steps, global batch 8, 2 workers, stage 2, replicas every
    step unless `sections` say otherwise: the tests count lost steps exactly, where "auto" would pick a
    cadence from this machine's timings: test_runtime.py has a test of it)."""
    data = {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "train": {"steps": 300, "global_batch": 8, "micro_batch": 4},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "zero": {"stage": 2},
        "elastic": {"workers": 2, "min_workers": 1, "max_workers": 3, "replicate_every": 1},
        "faults": list(faults),
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return spec_from_dict(data)


def job(tmp_path, name, faults=(), **sections):
    """Run `job_spec(name, faults, **sections)`: (exit code, summary, events, final weights or None)."""
    run_dir = tmp_path / name
    weights = tmp_path / f"{name}.pt"
    code = run_job(job_spec(name, faults, **sections), RunConfig(run_dir=str(run_dir), progress=False), final_weights=str(weights))
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    beyond = [e["message"] for e in events if e.get("event") == "warning" and "where the memory plan counts" in e.get("message", "")]
    assert not beyond, beyond  # a rank held more replicas than the memory plan counts (worker/commits.py)
    return code, summary, events, (torch.load(weights, weights_only=True) if code == 0 else None)


def relative(a, b):
    assert a.keys() == b.keys()
    va = torch.cat([a[k].flatten() for k in a])
    vb = torch.cat([b[k].flatten() for k in a])
    return ((va - vb).norm() / va.norm()).item()


def exactly_once(summary):
    assert summary["samples_consumed"] == summary["steps"] * summary["global_batch"]  # steps run in this job
    assert summary["duplicate_samples"] == 0 and summary["skipped_samples"] == 0
