"""`elastic-zero bench node-loss`: a whole node vanishes mid-run, on a local multi-node Ray cluster.

A head with no CPUs (driver and coordinator) and two worker nodes of two CPUs, four workers, two
per node. At a random moment after step `--freeze-after` one node is frozen (SIGSTOP to all its
processes: a machine that vanished, which resets no connections). Side by side in one run, each
trial on a fresh cluster: with the workers' heartbeats (`heartbeat_timeout_s`, the default) and
without them (0: the survivors learn of it at the collective timeout, or when Ray's health checks
mark the node dead). Times run from the freeze to the lost workers' detection and to the next
completed optimizer step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import textwrap
import time

from elastic_zero.testing.local_cluster import RayHead, RayNode
from elastic_zero.bench.recovery import first_recovery
from elastic_zero.observe.event_log import read_events


def _spec(preset: str, steps: int, heartbeat_timeout_s: float, collective_timeout_s: float) -> str:
    return textwrap.dedent(f"""\
        name = "bench-node-loss"
        [model]
        preset = "{preset}"
        [train]
        steps = {steps}
        global_batch = 16
        micro_batch = 4
        [elastic]
        workers = 4
        min_workers = 1
        max_workers = 4
        heartbeat_timeout_s = {heartbeat_timeout_s}
        collective_timeout_s = {collective_timeout_s}
        """)


def _trial(preset: str, steps: int, heartbeat_timeout_s: float, collective_timeout_s: float, freeze_after: int,
           rng: random.Random, work_dir: str) -> dict:
    head = RayHead(auth=False, num_cpus=0)
    nodes = []
    try:
        nodes = [RayNode(head, f"ez_node_{i}", num_cpus=2, index=i) for i in range(2)]
        with open(os.path.join(work_dir, "job.toml"), "w") as fh:
            fh.write(_spec(preset, steps, heartbeat_timeout_s, collective_timeout_s))
        run_dir = os.path.join(work_dir, "out")
        driver = head.run_job(work_dir, "job.toml", "node-loss")
        try:
            deadline = time.monotonic() + 300
            while True:
                record = head.job_status("node-loss")
                if record and record["world_size"] == 4 and (record["step"] or 0) >= freeze_after:
                    break
                if driver.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the job did not train on 4 workers; see {work_dir}/driver.log")
                time.sleep(0.5)
            time.sleep(rng.uniform(0.0, 1.0))  # anywhere in a step
            frozen_at = time.time()
            nodes[0].freeze()
            if driver.wait(timeout=600) != 0:
                summary_path = os.path.join(run_dir, "summary.json")
                error = json.load(open(summary_path)).get("error") if os.path.exists(summary_path) else None
                raise RuntimeError(f"the job failed ({error}); see {work_dir}")
        finally:
            if driver.poll() is None:
                driver.kill()
        events = read_events(run_dir)
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    finally:
        for node in nodes:
            node.stop()
        head.stop()
    change = first_recovery(summary, run_dir)
    next_step_done_at = change["failed_at"] + change["to_next_step_done_s"]
    # the frozen node's workers: those lost before the job trained again
    lost = [e for e in events if e["event"] == "worker_lost" and e["t"] <= next_step_done_at]
    return {"to_next_step_done_s": round(next_step_done_at - frozen_at, 3),
            "detected_after_s": round(max(e["t"] for e in lost) - frozen_at, 3),
            "lost_steps": change.get("lost_steps"), "by_silence": all(e.get("silent_s") for e in lost),
            "workers_lost": len(lost), "recoveries": len(summary["recoveries"]),
            "duplicate_samples": summary["duplicate_samples"],
            "skipped_samples": summary["skipped_samples"]}


def run_node_loss_bench(preset: str = "gpt-small", trials: int = 3, steps: int = 400, freeze_after: int = 10,
                        collective_timeout_s: float = 30.0, seed: int = 0, without: bool = True) -> dict:
    rng = random.Random(seed)
    modes = [("heartbeats", 1.0)] + ([("no_heartbeats", 0.0)] if without else [])
    if os.environ.get("ELASTIC_ZERO_BENCH_MODES"):  # one of them alone, to look into it
        modes = [m for m in modes if m[0] in os.environ["ELASTIC_ZERO_BENCH_MODES"].split(",")]
    report: dict = {"preset": preset, "trials": trials, "collective_timeout_s": collective_timeout_s}
    for name, timeout in modes:
        runs = []
        for _ in range(trials):
            work_dir = tempfile.mkdtemp(prefix="ez-node-loss-")
            runs.append(_trial(preset, steps, timeout, collective_timeout_s, freeze_after, rng, work_dir))
            shutil.rmtree(work_dir)  # kept when the trial failed
        report[name] = {"runs": runs,
                        "to_next_step_done_s_median": statistics.median(r["to_next_step_done_s"] for r in runs),
                        "detected_after_s_median": statistics.median(r["detected_after_s"] for r in runs)}
    if "heartbeats" in report and "no_heartbeats" in report:  # ELASTIC_ZERO_BENCH_MODES may have left one out
        report["ratio_without_to_with"] = round(report["no_heartbeats"]["to_next_step_done_s_median"]
                                                / report["heartbeats"]["to_next_step_done_s_median"], 1)
    return report


def format_node_loss(r: dict) -> str:
    lines = [f"a whole node (2 of 4 workers) frozen mid-run, {r['preset']}, {r['trials']} trial(s) each, "
             f"collective timeout {r['collective_timeout_s']:g} s"]
    for name in ("heartbeats", "no_heartbeats"):
        if name not in r:
            continue
        m = r[name]
        lines.append(f"  {name:14s} detected after {m['detected_after_s_median']:.2f} s, next step done after "
                     f"{m['to_next_step_done_s_median']:.2f} s (medians); per trial: "
                     + ", ".join(f"{x['to_next_step_done_s']:.2f} s ({x['lost_steps']} lost steps)" for x in m["runs"]))
    if "ratio_without_to_with" in r:
        lines.append(f"  without heartbeats / with: {r['ratio_without_to_with']}x")
    return "\n".join(lines)
