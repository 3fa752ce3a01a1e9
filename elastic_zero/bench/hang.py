"""`elastic-zero bench recovery --fault hang` (or hang_in_data, hang_in_collective): a worker alive but
not training, against a kill of the same rank at the same step and the same job without a fault,
in one run, with the default settings (collective timeout 30 s, stuck after 3 measured steps, at
least 2 s). Reported: how long the hung worker stood still before it was found (plan/stuck.py), the
fault to the next completed step for the hang and the kill, and what each cost the job: its
training time (first step done to last) over the fault-free job's.
"""

from __future__ import annotations

import json
import os

from elastic_zero.bench.scratch import scratch_dir
from elastic_zero.bench.recovery import check_fault_run, first_recovery, run_fault_job
from elastic_zero.job.spec import HANG_ACTIONS


def _run(name: str, preset: str, workers: int, steps: int, micro_batch: int, faults: list, work_dir: str):
    """(summary, events, the training's seconds: its first step done to its last) of one job."""
    summary, run_dir = run_fault_job(name, preset, workers, steps, micro_batch, faults, work_dir)
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    ends = [t for _, t in summary["step_end_curve"]]
    return summary, events, max(ends) - min(ends), first_recovery(summary, run_dir) if faults else None


def run_hang_bench(fault: str, preset: str = "gpt-small", workers: int = 3, steps: int = 60, hang_step: int = 20,
                   micro_batch: int = 8) -> dict:
    import ray

    if fault not in HANG_ACTIONS:
        raise ValueError(f"--fault: got {fault!r}; allowed: kill, {', '.join(HANG_ACTIONS)}")
    check_fault_run(preset, workers, steps, hang_step)
    with scratch_dir("elastic-zero-bench-") as work_dir:  # (it goes once Ray is down)
        ray.init(num_cpus=workers + 2, include_dashboard=False, logging_level="ERROR", namespace="elastic_zero")
        try:
            runs = {name: _run(name, preset, workers, steps, micro_batch, faults, work_dir) for name, faults in (
                ("clean", []), (fault, [{"at_step": hang_step, "action": fault, "rank": 1}]),
                ("kill", [{"at_step": hang_step, "action": "kill", "rank": 1}]))}
        finally:
            ray.shutdown()
    clean_s = runs["clean"][2]
    stuck = [e for e in runs[fault][1] if e["event"] == "worker_stuck"]
    return {"preset": preset, "workers": workers, "steps": steps, "hang_step": hang_step, "fault": fault,
            "found_by": "stuck rule" if stuck else "collective timeout",
            "still_before_found_s": stuck[0]["still_s"] if stuck else None,
            "hang_to_next_step_s": runs[fault][3]["to_next_step_done_s"],
            "kill_to_next_step_s": runs["kill"][3]["to_next_step_done_s"],
            "training_s": {name: round(run[2], 3) for name, run in runs.items()},
            "hang_extra_s": runs[fault][2] - clean_s, "kill_extra_s": runs["kill"][2] - clean_s,
            "step_time_s_median": runs["clean"][0]["step_time_s_median"]}


def format_hang(r: dict) -> str:
    found = (f"found stuck after {r['still_before_found_s']:.2f} s still" if r["still_before_found_s"] is not None
             else "found by the collective timeout")
    return "\n".join([
        f"bench recovery --fault {r['fault']}: {r['preset']}, {r['workers']} CPU workers, rank 1 at step "
        f"{r['hang_step']} of {r['steps']} (median step {r['step_time_s_median']:.3f} s)",
        f"  {r['fault']:<18} {found}; fault -> next step done {r['hang_to_next_step_s']:.2f} s; the job's "
        f"training {r['training_s'][r['fault']]:.2f} s, {r['hang_extra_s']:+.2f} s on the fault-free job's "
        f"{r['training_s']['clean']:.2f} s",
        f"  {'kill':<18} fault -> next step done {r['kill_to_next_step_s']:.2f} s; the job's training "
        f"{r['training_s']['kill']:.2f} s, {r['kill_extra_s']:+.2f} s"])
