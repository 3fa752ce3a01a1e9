"""`elastic-zero bench recovery`: kill one of N workers mid-run, here and in Ray Train (or torchft,
`--against torchft`: bench/torchft_job.py), in one run.

elastic_zero: the survivors go on from the buddy replicas; a replacement joins later (its join is
the scale-up stall). Ray Train: an elastic TorchTrainer (ScalingConfig(num_workers=(min, max)),
FailureConfig, a checkpoint every few steps) restarts its worker group from the last checkpoint.
Both train the same preset, data and global batch; both times run from the moment the killed
process records its death to the next completed optimizer step.
"""

from __future__ import annotations

import json
import os

from elastic_zero.bench.scratch import scratch_dir
from elastic_zero.models import PRESETS


def run_fault_job(name: str, preset: str, workers: int, steps: int, micro_batch: int, faults: list,
                  work_dir: str, job_name: str | None = None) -> tuple[dict, str]:
    """A fault bench's job (`job_name`, default bench-NAME) on the running Ray, its outputs in
    `work_dir/name`: (its summary, that directory)."""
    from elastic_zero.api import RunConfig, run_job
    from elastic_zero.job.spec import spec_from_dict

    spec = spec_from_dict({
        "name": job_name or f"bench-{name}",
        "model": {"preset": preset},
        "train": {"steps": steps, "global_batch": micro_batch * workers, "micro_batch": micro_batch},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "elastic": {"workers": workers, "min_workers": 1, "max_workers": workers},
        "faults": faults,
    })
    run_dir = os.path.join(work_dir, name)
    if run_job(spec, RunConfig(run_dir=run_dir, progress=False)) != 0:
        raise RuntimeError(f"the {name} run failed; see {run_dir}")
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return json.load(fh), run_dir


def _elastic_zero(preset, workers, steps, kill_step, micro_batch, work_dir) -> dict:
    summary, run_dir = run_fault_job("elastic_zero", preset, workers, steps, micro_batch,
                                     [{"at_step": kill_step, "action": "kill", "rank": 1}], work_dir, "bench-recovery")
    rec = first_recovery(summary, run_dir)
    ups = [c for c in summary["reconfigurations"] if c["to"] > c["from"]]
    # the replacement trains again when the generation it joined completes its first step
    replacement = (ups[0]["failed_at"] + ups[0]["to_next_step_done_s"] - rec["failed_at"]
                   if ups and ups[0].get("to_next_step_done_s") is not None else None)
    return {"recovery_s": rec["to_next_step_done_s"], "recomputed_steps": rec["recomputed_steps"],
            "lost_steps": rec["lost_steps"], "scale_up_stall_s": ups[0]["stall_s"] if ups else None,
            "replacement_s": replacement, "state_bytes_per_rank": summary.get("engine_bytes_per_rank"),
            "step_time_s_median": summary["step_time_s_median"],
            "time_to_first_step_s": summary["time_to_first_step_s"], "recoveries": len(summary["recoveries"])}


def first_recovery(summary: dict, run_dir: str) -> dict:
    """The recovery from the bench's own fault: the first. A later one (a live worker taken for lost
    on a loaded machine, say) is the run's to report as a count, not to measure."""
    if not summary["recoveries"]:
        raise RuntimeError(f"the elastic_zero run recorded no recovery; see {run_dir}")
    first = min(summary["recoveries"], key=lambda r: r["failed_at"])
    if first.get("to_next_step_done_s") is None:  # the job ended before it trained again
        raise RuntimeError(f"the elastic_zero run's recovery at step {first.get('step')} completed no step after it "
                           f"(the job ended first: give the bench more steps); see {run_dir}")
    return first


def check_fault_run(preset: str, workers: int, steps: int, fault_step: int) -> None:
    """A fault bench's job, checked: one line naming what is wrong."""
    if workers < 2 or not 0 < fault_step < steps:
        raise ValueError("need --workers >= 2 and 0 < --kill-step < --steps")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")


def _ray_train(preset, workers, steps, kill_step, micro_batch, checkpoint_every, work_dir) -> dict:
    from elastic_zero.bench.ray_train_job import run_trainer

    log, marker = os.path.join(work_dir, "ray_train_steps.jsonl"), os.path.join(work_dir, "ray_train_killed")
    config = {"preset": preset, "steps": steps, "kill_step": kill_step, "micro_batch": micro_batch,
              "global_batch": micro_batch * workers, "checkpoint_every": checkpoint_every, "log": log,
              "marker": marker}
    run_trainer(config, 1, workers, os.path.join(work_dir, "ray_train"), "bench-recovery")
    with open(marker) as fh:
        killed_at = float(fh.read())
    records = [json.loads(line) for line in open(log)]
    killed_attempt = [r for r in records if r["done"] <= killed_at][-1]["attempt"]
    first = [r for r in records if r["attempt"] == killed_attempt]
    after = [r for r in records if r["attempt"] != killed_attempt]  # the restarted worker group
    before = {r["step"] for r in first}
    return {"recovery_s": after[0]["done"] - killed_at,
            "recomputed_steps": len({r["step"] for r in after} & before),
            "step_time_s_median": _median_step_s([r for r in records if r["done"] < killed_at])}


def _median_step_s(records: list[dict]) -> float | None:
    """The median time between one logged step's end and the next step's, in log order."""
    times = sorted(b["done"] - a["done"] for a, b in zip(records, records[1:]) if b["step"] == a["step"] + 1)
    return times[len(times) // 2] if times else None


def run_torchft(config: dict, groups: int, work_dir: str, timeout_s: float = 900.0) -> list[dict]:
    """Runs `groups` torchft replica groups until every one finished `config["steps"]`, starting the
    one that killed itself (`kill_step`) once more, as torchrun's restarts or torchx would; returns
    every group's step log. Any other exit of a group is an error naming it and its last line."""
    from elastic_zero.bench.torchft_cluster import TorchftCluster, supervise

    with TorchftCluster(config, groups, work_dir) as cluster:
        for group in range(groups):
            cluster.start(group)

        def restart_the_killed(slot: int, code: int) -> bool:
            if slot != 1 or not os.path.exists(config["marker"]) or cluster.started > groups:
                return False
            cluster.start(slot)
            return True

        supervise(cluster, lambda: not cluster.procs, timeout_s, "end", restart_the_killed)
        return cluster.records()


def _torchft(preset, workers, steps, kill_step, micro_batch, work_dir) -> dict:
    marker = os.path.join(work_dir, "torchft_killed")
    config = {"preset": preset, "steps": steps, "kill_step": kill_step, "micro_batch": micro_batch,
              "global_batch": micro_batch * workers, "marker": marker}
    lines = run_torchft(config, workers, os.path.join(work_dir, "torchft"))
    with open(marker) as fh:
        killed_at = float(fh.read())
    died_at_step = max(r["step"] for r in lines if r["group"] == 1 and r["committed"] and r["done"] <= killed_at) + 1
    survivors = [r for r in lines if r["group"] != 1]
    # a survivor may still commit a step the killed group had finished its part of
    after = [r for r in survivors if r["done"] > killed_at and r["step"] >= died_at_step]
    killed_attempts = {r["attempt"] for r in lines if r["group"] == 1 and r["done"] <= killed_at}
    # training again: its first step that counted every group (a healing group's first commit does not)
    replaced = [r for r in lines if r["group"] == 1 and r["attempt"] not in killed_attempts and r["committed"]
                and r["participants"] == workers]
    return {"recovery_s": min(r["done"] for r in after if r["committed"]) - killed_at,
            # a survivor's step that failed with the lost group is discarded and run again
            "recomputed_steps": len({r["step"] for r in after if not r["committed"]}),
            "replacement_s": min(r["done"] for r in replaced) - killed_at if replaced else None,
            "state_bytes_per_rank": max(r.get("state_bytes", 0) for r in lines),
            "step_time_s_median": _median_step_s([r for r in survivors if r["committed"] and r["done"] < killed_at
                                                  and r["group"] == 0])}


AGAINST = ("ray-train", "torchft")


def run_recovery_bench(preset: str = "gpt-small", workers: int = 3, steps: int = 24, kill_step: int = 8,
                       micro_batch: int = 8, checkpoint_every: int = 5, against: str = "ray-train") -> dict:
    """Our recovery beside `against`'s (AGAINST), the same kill in one run. Keys name the system:
    `elastic_zero_*`, `ray_train_*` or `torchft_*`; `ratio` is ours over theirs."""
    import ray

    if against not in AGAINST:
        raise ValueError(f"--against: got {against!r}; allowed: {', '.join(AGAINST)}")
    check_fault_run(preset, workers, steps, kill_step)
    if against == "torchft":
        from elastic_zero.bench.torchft_cluster import MISSING, torchft_installed

        if not torchft_installed():
            raise ValueError(f"--against torchft: {MISSING}")
    with scratch_dir("elastic-zero-bench-") as work_dir:
        ray.init(num_cpus=workers + 2, include_dashboard=False, logging_level="ERROR", namespace="elastic_zero")
        try:
            ours = _elastic_zero(preset, workers, steps, kill_step, micro_batch, work_dir)
            if against == "ray-train":
                theirs = _ray_train(preset, workers, steps, kill_step, micro_batch, checkpoint_every, work_dir)
        finally:
            ray.shutdown()
        if against == "torchft":  # its own processes, with Ray down
            theirs = _torchft(preset, workers, steps, kill_step, micro_batch, work_dir)
    key = against.replace("-", "_")
    report = {
        "preset": preset, "workers": workers, "kill_step": kill_step, "against": against,
        "elastic_zero_recovery_s": ours["recovery_s"],
        f"{key}_recovery_s": theirs["recovery_s"],
        "ratio": ours["recovery_s"] / theirs["recovery_s"],
        "elastic_zero_recomputed_steps": ours["recomputed_steps"],
        f"{key}_recomputed_steps": theirs["recomputed_steps"],
        "elastic_zero_lost_steps": ours["lost_steps"],
        "elastic_zero_recoveries": ours["recoveries"],  # 1 unless the run lost a worker the bench did not kill
        "scale_up_stall_s": ours["scale_up_stall_s"],
        "elastic_zero_step_time_s_median": ours["step_time_s_median"],
        f"{key}_step_time_s_median": theirs["step_time_s_median"],
        "elastic_zero_time_to_first_step_s": ours["time_to_first_step_s"],
        "elastic_zero_replacement_s": ours["replacement_s"],
        "elastic_zero_state_bytes_per_rank": ours["state_bytes_per_rank"],
    }
    if against == "ray-train":
        report["checkpoint_every"] = checkpoint_every
    else:
        report.update({"torchft_replacement_s": theirs["replacement_s"],
                       "torchft_state_bytes_per_rank": theirs["state_bytes_per_rank"]})
    return report


def _secs(x) -> str:
    return f"{x:.2f} s" if x is not None else "-"


def format_recovery(r: dict) -> str:
    lines = [f"bench recovery: {r['preset']}, {r['workers']} CPU workers, rank 1 killed at step {r['kill_step']}",
             f"  elastic_zero  kill -> next step done {r['elastic_zero_recovery_s']:.3f} s, "
             f"recomputed steps {r['elastic_zero_recomputed_steps']} (completed steps lost {r['elastic_zero_lost_steps']})"]
    if r.get("elastic_zero_recoveries", 1) > 1:
        lines[1] += f"; the run recovered {r['elastic_zero_recoveries']} times, the first is the kill's"
    if r["against"] == "ray-train":
        lines += [f"  Ray Train     kill -> next step done {r['ray_train_recovery_s']:.3f} s, "
                  f"recomputed steps {r['ray_train_recomputed_steps']} (checkpoint every {r['checkpoint_every']} steps)",
                  f"  ratio {r['ratio']:.3f};  scale-up stall {_secs(r['scale_up_stall_s'])}"]
        return "\n".join(lines)

    def mib(n):
        return f"{n / 2**20:.1f} MiB" if n else "-"

    lines[1] += (f", replacement training again {_secs(r['elastic_zero_replacement_s'])}, model state "
                 f"{mib(r['elastic_zero_state_bytes_per_rank'])} per rank")
    lines += [f"  torchft       kill -> next step done {r['torchft_recovery_s']:.3f} s, "
              f"recomputed steps {r['torchft_recomputed_steps']}, replacement training again "
              f"{_secs(r['torchft_replacement_s'])}, model state {mib(r['torchft_state_bytes_per_rank'])} per rank",
              f"  ratio {r['ratio']:.3f};  step time {_secs(r['elastic_zero_step_time_s_median'])} vs "
              f"{_secs(r['torchft_step_time_s_median'])}"]
    return "\n".join(lines)
