"""`elastic-zero bench recovery --fault kill_coordinator`: the job's coordinator killed mid-run (rank 0
kills it before the step, as its process dying would), against a kill of rank 1 at the same step
and the same job without a fault, in one run.

Reported for each: the longest pause between two step ends after the fault (the stall: for the
coordinator, its replacement's start and the takeover), the steps trained again, and the job's
training time (first step done to last) over the fault-free job's. The coordinator's replacement
takes the workers over from their memory (coordinator/takeover.py): the goal is no step trained
again and a stall of at most 5 s.
"""

from __future__ import annotations

import json
import os

from elastic_zero.bench.scratch import scratch_dir
from elastic_zero.bench.recovery import check_fault_run, run_fault_job

WINDOW = 5  # steps after the fault whose pauses count as its stall


def _run(name: str, preset: str, workers: int, steps: int, micro_batch: int, faults: list, work_dir: str,
         fault_step: int) -> dict:
    summary, run_dir = run_fault_job(name, preset, workers, steps, micro_batch, faults, work_dir)
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    ends = [t for step, t in sorted(summary["step_end_curve"])]
    curve = sorted(summary["step_end_curve"])
    # the pauses of the steps around the fault (a replacement's join, later, is a stall of its own)
    after = [b - a for (s, a), (_, b) in zip(curve, curve[1:]) if fault_step - 1 <= s <= fault_step + WINDOW]
    return {"training_s": max(ends) - min(ends), "stall_s": max(after) if after else None,
            "retrained_steps": retrained_steps(events), "restarts": summary.get("coordinator_restarts", 0),
            "taken_over": any(e["event"] == "generation_taken_over" for e in events),
            "checkpoint_read": any(e["event"] == "checkpoint_restored" for e in events),
            "step_time_s_median": summary["step_time_s_median"]}


def retrained_steps(events: list[dict]) -> int:
    """Steps a generation trained that a later one trained again: each generation's steps done past
    the step the next one started from."""
    done = {e["generation"]: e["steps_done"] for e in events if e["event"] == "generation_end" and "steps_done" in e}
    starts = {e["generation"]: e["step"] for e in events if e["event"] == "generation_start"}
    again = 0
    for number, reached in done.items():
        following = starts.get(number + 1)
        if reached is not None and following is not None and following >= 0:
            again += max(0, reached - following)
    return again


def run_coordinator_loss_bench(preset: str = "gpt-small", workers: int = 3, steps: int = 40, fault_step: int = 15,
                               micro_batch: int = 8) -> dict:
    import ray

    check_fault_run(preset, workers, steps, fault_step)
    with scratch_dir("elastic-zero-bench-") as work_dir:  # (it goes once Ray is down)
        ray.init(num_cpus=workers + 2, include_dashboard=False, logging_level="ERROR", namespace="elastic_zero")
        try:
            runs = {name: _run(name, preset, workers, steps, micro_batch, faults, work_dir, fault_step)
                    for name, faults in (("clean", []),
                                         ("kill_coordinator", [{"at_step": fault_step, "action": "kill_coordinator",
                                                                "rank": 0}]),
                                         ("kill", [{"at_step": fault_step, "action": "kill", "rank": 1}]))}
        finally:
            ray.shutdown()
    clean = runs["clean"]["training_s"]
    return {"preset": preset, "workers": workers, "steps": steps, "fault_step": fault_step,
            "step_time_s_median": runs["clean"]["step_time_s_median"],
            **{f"{name}_{key}": value for name, run in runs.items() if name != "clean" for key, value in run.items()
               if key != "step_time_s_median"},
            "clean_training_s": clean,
            "kill_coordinator_extra_s": runs["kill_coordinator"]["training_s"] - clean,
            "kill_extra_s": runs["kill"]["training_s"] - clean}


def format_coordinator_loss(r: dict) -> str:
    def line(name: str) -> str:
        return (f"  {name:<17} stall {r[f'{name}_stall_s']:.2f} s, steps trained again {r[f'{name}_retrained_steps']}, "
                f"the job's training {r[f'{name}_training_s']:.2f} s ({r[f'{name}_extra_s']:+.2f} s on the "
                f"fault-free {r['clean_training_s']:.2f} s)")

    how = ("taken over from the workers' memory" if r["kill_coordinator_taken_over"] else "not taken over") + \
        ("; a checkpoint was read" if r["kill_coordinator_checkpoint_read"] else "; no checkpoint read")
    return "\n".join([
        f"bench recovery --fault kill_coordinator: {r['preset']}, {r['workers']} CPU workers, at step "
        f"{r['fault_step']} of {r['steps']} (median step {r['step_time_s_median']:.3f} s)",
        line("kill_coordinator") + f"; {how}",
        line("kill")])
