"""`elastic-zero bench chaos`: the job of examples/chaos.toml under seeded fault schedules, each run
checked against the same job without faults on one worker:

- it ends with exit 0;
- every sample of every step is consumed exactly once, counted from the sample records;
- the final weights are within 1e-4 (relative, over all parameters) of the fault-free run;
- every committed checkpoint left behind loads.

Reports per run the faults that fired, the recoveries and reconfigurations, and the stalls.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import tomllib

import torch

from elastic_zero.bench.chaos_schedule import KINDS, chaos_faults, fault_kinds
from elastic_zero.observe.event_log import read_events
from elastic_zero.observe.live import world_size_history

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "chaos.toml")


def chaos_job(seed: int, steps: int, stage: int, checkpoint_uri: str, checkpoint_every: int = 20,
              replicate_every: int | str | None = None, standby_workers: int = 0, kinds: tuple = KINDS) -> dict:
    """The drill's spec (as a dict) for one seed; `replicate_every` in place of the example's,
    `standby_workers` kept ready beside the job (the recoveries and scale-ups take them first), and
    faults of the `kinds` given (chaos_schedule.py)."""
    with open(EXAMPLE, "rb") as fh:
        data = tomllib.load(fh)
    e = data["elastic"]
    if replicate_every is not None:
        e["replicate_every"] = replicate_every
    if standby_workers:
        e["standby_workers"] = standby_workers
    data["name"] = f"chaos-{seed}-s{stage}"
    data["train"]["steps"] = steps
    data["zero"]["stage"] = stage
    data["checkpoint"].update(uri=checkpoint_uri, every=checkpoint_every)
    data["faults"] = chaos_faults(seed, steps, checkpoint_every, e["min_workers"], e["max_workers"], kinds)
    return data


def _relative(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    va = torch.cat([a[k].flatten() for k in a])
    vb = torch.cat([b[k].flatten() for k in a])
    return ((va - vb).norm() / va.norm()).item()


def _run(data: dict, run_dir: str) -> tuple[int, dict, list, dict | None]:
    from elastic_zero.api import RunConfig, run_job
    from elastic_zero.job.spec import spec_from_dict

    weights = os.path.join(run_dir, "final.pt")
    os.makedirs(run_dir, exist_ok=True)
    # its console and its workers' output (Ray's, forwarded) to the run's log: the drill prints its report
    with open(os.path.join(run_dir, "run.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        code = run_job(spec_from_dict(data), RunConfig(run_dir=run_dir, progress=False), final_weights=weights)  # its "done" line is not the report
    try:
        with open(os.path.join(run_dir, "summary.json")) as fh:
            summary = json.load(fh)
    except FileNotFoundError:  # the driver gave up on the job (its coordinator lost for good): what it said
        with open(os.path.join(run_dir, "run.log")) as fh:
            said = [line.strip() for line in fh if line.startswith("elastic-zero:")]
        summary = {"ok": False, "error": said[-1] if said else "no summary.json, and the driver said nothing"}
    events = read_events(run_dir)
    return code, summary, events, (torch.load(weights, weights_only=True) if code == 0 else None)


def _checkpoints_that_do_not_load(uri: str) -> list[str]:
    from elastic_zero.checkpoint import list_checkpoints, load_shard, open_store, read_manifest
    from elastic_zero.plan.layout import FlatLayout

    fs, root = open_store(uri)
    broken = []
    for _, directory in list_checkpoints(fs, root):
        try:
            layout = FlatLayout.from_dict(read_manifest(fs, directory).layout)
            load_shard(fs, directory, layout, 1, 0)
        except ValueError as exc:
            broken.append(f"{directory}: {exc}")
    return broken


def run_chaos(seeds, steps: int, stages, workdir: str, checkpoint_every: int = 20,
              replicate_every: int | str | None = None, standby_workers: int = 0, kinds: tuple = KINDS) -> dict:
    import ray

    if replicate_every is not None and replicate_every != "auto" and \
            not (isinstance(replicate_every, int) and not isinstance(replicate_every, bool) and replicate_every >= 0):
        raise ValueError(f'--replicate-every: an integer >= 0 or "auto", got {replicate_every!r}')
    if not (isinstance(standby_workers, int) and not isinstance(standby_workers, bool) and 0 <= standby_workers <= 4):
        raise ValueError(f"--standby-workers: an integer from 0 to 4, got {standby_workers!r}")
    if checkpoint_every < 1:  # its faults come after the first checkpoint, and some right after one
        raise ValueError(f"--checkpoint-every: must be >= 1 (the drill's faults are placed by its checkpoints), "
                         f"got {checkpoint_every}")
    if steps < 1 or not seeds or not stages:
        raise ValueError(f"--steps: must be >= 1, got {steps}" if steps < 1 else
                         f"--{'seeds' if not seeds else 'stages'}: name at least one")
    kinds = fault_kinds(kinds if isinstance(kinds, str) else ",".join(kinds))  # each one known, or one line naming it
    if any(stage not in (1, 2, 3) for stage in stages):
        raise ValueError(f"--stages: ZeRO stages 1, 2 or 3, got {','.join(map(str, stages))}")
    own_ray = not ray.is_initialized()
    if own_ray:  # a slot for each worker at the most (4), each standby, and a replacement started beside them
        ray.init(num_cpus=max(os.cpu_count() or 1, 5 + standby_workers), namespace="elastic_zero",
                 include_dashboard=False, logging_level="ERROR")
    runs = []
    try:
        for stage in stages:
            quiet = chaos_job(0, steps, stage, os.path.join(workdir, f"reference-s{stage}", "ckpt"), checkpoint_every)
            quiet.update(name=f"chaos-reference-s{stage}", faults=[])
            quiet["elastic"].update(workers=1, min_workers=1, max_workers=1)
            code, _, _, reference = _run(quiet, os.path.join(workdir, f"reference-s{stage}"))
            if code != 0:
                raise RuntimeError(f"the fault-free reference run of stage {stage} failed")
            for seed in seeds:
                run_dir = os.path.join(workdir, f"seed{seed}-s{stage}")
                data = chaos_job(seed, steps, stage, os.path.join(run_dir, "ckpt"), checkpoint_every, replicate_every,
                                 standby_workers, kinds)
                started = time.monotonic()
                code, summary, events, weights = _run(data, run_dir)
                runs.append(_judge(seed, stage, data, code, summary, events, weights, reference,
                                   time.monotonic() - started))
    finally:
        if own_ray:
            ray.shutdown()
    stalls = [s for r in runs for s in r["stalls_s"]]
    starts = [s for r in runs for s in r["worker_starts_s"]]
    ready_after = [s for r in runs for s in r["workers_ready_after_s"]]
    return {"steps": steps, "replicate_every": replicate_every, "standby_workers": standby_workers,
            "faults": list(kinds), "runs": runs,
            "failed_runs": [f"seed {r['seed']} stage {r['stage']}" for r in runs if not r["ok"]],
            "faults_survived": sum(r["faults_fired"] for r in runs if r["ok"]),
            "stall_s_median": round(statistics.median(stalls), 4) if stalls else None, "stall_s_worst": max(stalls, default=None),
            "changes_with_a_worker_ready_after_them": len(starts),
            "worker_start_s_median": round(statistics.median(starts), 4) if starts else None,
            "worker_ready_after_s_median": round(statistics.median(ready_after), 4) if ready_after else None}


def _judge(seed, stage, data, code, summary, events, weights, reference, wall_s) -> dict:
    kinds = [e["event"] for e in events]
    # a fault counts once it changed the membership: a scale to the size the job has, or a drill
    # waiting for a handover that never came, does nothing
    changes = summary.get("recoveries", []) + summary.get("reconfigurations", [])
    problems = []
    if code != 0:
        problems.append(f"exit {code}: {summary.get('error')}")
    else:
        expected = data["train"]["steps"] * summary["global_batch"]  # every step's, however many coordinators booked them
        if summary["samples_consumed"] != expected or summary["duplicate_samples"] or summary["skipped_samples"]:
            problems.append(f"samples: {summary['samples_consumed']} of {expected}, {summary['duplicate_samples']} "
                            f"duplicated, {summary['skipped_samples']} skipped")
        # every generation's [step, size], as the job's status reads them from the log (a step it does not know: any)
        known, booked = world_size_history(events), summary["world_size_history"]
        if len(known) != len(booked) or any(n != m or s not in (None, t) for (s, n), (t, m) in zip(known, booked)):
            problems.append(f"world sizes: the summary's {booked} are not the job's {known}")
        diff = _relative(reference, weights)
        if not diff <= 1e-4:
            problems.append(f"final weights {diff:.2e} from the fault-free run")
    problems += _checkpoints_that_do_not_load(data["checkpoint"]["uri"])
    return {"seed": seed, "stage": stage, "ok": not problems, "problems": problems, "exit_code": code,
            "replicas": summary.get("replicas"),
            "faults_scheduled": len(data["faults"]), "faults_fired": len(changes),
            "workers_lost": kinds.count("worker_lost"), "preemption_notices": kinds.count("preemption_notice"),
            "recoveries": len(summary.get("recoveries", [])), "reconfigurations": len(summary.get("reconfigurations", [])),
            "coordinator_restarts": summary.get("coordinator_restarts", 0),
            "stalls_s": [c["stall_s"] for c in changes if c.get("stall_s") is not None],
            # the changes that took in a worker ready only after they began: its start, whole, and how far
            # into the change it was ready (a replacement asked for an earlier loss may come at once)
            "worker_starts_s": [round(sum(c["worker_start_s"].values()), 4) for c in changes if c.get("worker_start_s")],
            "workers_ready_after_s": [c["worker_ready_after_s"] for c in changes if c.get("worker_start_s")],
            "world_sizes": [n for _, n in summary.get("world_size_history", [])],
            "weights_diff": None if weights is None else _relative(reference, weights), "wall_s": round(wall_s, 1)}


def format_chaos(report: dict) -> str:
    every = report.get("replicate_every")
    lines = [f"chaos drill, {report['steps']} steps per run" + (f", replicate_every {every}" if every is not None else "")
             + (f", {report['standby_workers']} standby worker(s)" if report.get("standby_workers") else "")
             + (f", faults {','.join(report['faults'])}" if tuple(report.get("faults", KINDS)) != KINDS else "")]
    for r in report["runs"]:
        stalls = r["stalls_s"]
        lines.append(f"  seed {r['seed']} stage {r['stage']}: {'ok' if r['ok'] else 'FAILED'}  "
                     f"{r['recoveries']} recoveries ({r['workers_lost']} workers lost), "
                     f"{r['reconfigurations']} reconfigurations ({r['preemption_notices']} preemption notices) "
                     + (f"{r['coordinator_restarts']} coordinator restart(s) " if r.get("coordinator_restarts") else "")
                     + f"from {r['faults_scheduled']} scheduled faults, "
                     f"stall median {statistics.median(stalls) if stalls else 0:.3f} s worst {max(stalls, default=0):.3f} s, "
                     f"weights {r['weights_diff'] if r['weights_diff'] is not None else float('nan'):.1e}, {r['wall_s']} s"
                     + (f", last cadence every {r['replicas']['every']} step(s)" if (r.get("replicas") or {}).get("auto") else "")
                     + ("".join(f"\n      {p}" for p in r["problems"])))
    lines.append(f"faults survived: {report['faults_survived']}; stall median {report['stall_s_median']} s, "
                 f"worst {report['stall_s_worst']} s; failed runs: {', '.join(report['failed_runs']) or 'none'}")
    if report.get("changes_with_a_worker_ready_after_them"):
        lines.append(f"{report['changes_with_a_worker_ready_after_them']} change(s) took in a worker ready after they "
                     f"began: ready {report['worker_ready_after_s_median']} s into the change, its whole start "
                     f"{report['worker_start_s_median']} s (medians)")
    return "\n".join(lines)
