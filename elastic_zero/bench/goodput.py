"""`elastic-zero bench goodput`: one seeded schedule of node losses, a preemption notice and new
nodes, played to elastic_zero and to an elastic Ray Train TorchTrainer, each on a fresh local
multi-node Ray cluster, and (`--against torchft`) to torchft's replica groups, in one run (see
goodput_schedule.py for the schedule and the accounting, goodput_cluster.py for the cluster and how
each event is played).

Both train the same preset, data and global batch with four workers (two per node, `min_workers` 1),
checkpoint every `checkpoint_every` steps to the same kind of storage (a local directory), and are
asked to stop at the window's end. elastic_zero watches Ray's drains (the notice is one) and keeps
its in-memory replicas; Ray Train uses its own preemption notice (`get_preemption_info`, a
just-in-time checkpoint) and restarts its worker group from the latest checkpoint on a loss, a
preemption and each resize. torchft (goodput_torchft.py) runs a replica group per worker, two to a
"node" of processes frozen or killed together, with no checkpoint and no notice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

from elastic_zero.testing.autoscaled_cluster import AutoscaledCluster
from elastic_zero.bench.goodput_autoscaled import WORKERS_AUTOSCALED, AutoscaledPlayer, spot_labels
from elastic_zero.bench.goodput_schedule import (
    autoscaled_schedule, elastic_zero_figures, goodput_schedule, ray_train_figures,
)
from elastic_zero.bench.goodput_cluster import (
    CPUS_PER_NODE, GLOBAL_BATCH, MICRO_BATCH, WORKERS, BenchCluster, play_to_cluster, run_schedule,
)
from elastic_zero.observe.event_log import read_events

SYSTEMS = ("elastic_zero", "ray_train", "torchft")
DEFAULT_SYSTEMS = ("elastic_zero", "ray_train")  # with neither --systems nor --against


def _first_line(path: str) -> dict | None:
    """The file's first complete JSON line; None while the job has not written it yet."""
    try:
        with open(path) as fh:
            line = fh.readline()
        return json.loads(line) if line.endswith("\n") else None
    except (OSError, ValueError):  # not created yet, or a line still being written: asked again shortly
        return None


def _elastic_zero_first_step(events_path: str) -> float | None:
    """When rank 0 told the coordinator the job's first step was done (its event log, as it grows)."""
    try:
        with open(events_path) as fh:
            for line in fh:
                if '"GenerationStepped"' in line and line.endswith("\n"):
                    return json.loads(line)["t"]
    except OSError:  # the coordinator has not created its event log yet: asked again shortly
        pass
    return None


def _elastic_zero_spec(preset: str, checkpoint_uri: str, checkpoint_every: int, loss: str | None,
                       workers: int = WORKERS, labels: dict | None = None) -> str:
    loss_line = f'loss = "{loss}"' if loss else ""
    labels_line = "worker_labels = {" + ", ".join(f'"{k}" = "{v}"' for k, v in labels.items()) + "}" if labels else ""
    return textwrap.dedent(f"""\
        name = "bench-goodput"
        [model]
        preset = "{preset}"
        [train]
        {loss_line}
        steps = 1000000
        global_batch = {GLOBAL_BATCH}
        micro_batch = {MICRO_BATCH}
        [elastic]
        workers = {workers}
        min_workers = 1
        max_workers = {workers}
        {labels_line}
        [checkpoint]
        uri = "{checkpoint_uri}"
        every = {checkpoint_every}
        [preemption]
        watch = ["ray-drain", "sigterm"]
        """)


def _player(cluster, stop_job):
    """What carries out each event of the schedule on `cluster` (an autoscaled one, or nodes of this machine)."""
    if isinstance(cluster, AutoscaledCluster):
        return AutoscaledPlayer(cluster, stop_job)
    return lambda event: play_to_cluster(event, cluster, stop_job)


def _elastic_zero(preset: str, schedule, checkpoint_every: int, work_dir: str, clock: str,
                  loss_file: str | None = None, autoscaled: bool = False) -> dict:
    if loss_file:  # beside job.toml, in the driver's directory, which Ray puts on the workers' sys.path
        shutil.copy(loss_file, work_dir)
    loss = os.path.basename(loss_file)[:-len(".py")] + ":loss" if loss_file else None
    cluster = AutoscaledCluster() if autoscaled else BenchCluster()
    try:
        with open(os.path.join(work_dir, "job.toml"), "w") as fh:
            fh.write(_elastic_zero_spec(preset, f"file://{work_dir}/checkpoints", checkpoint_every, loss,
                                        *((WORKERS_AUTOSCALED, spot_labels()) if autoscaled else ())))
        launched_at = time.time()
        driver = cluster.head.run_job(work_dir, "job.toml", "goodput")

        def stop_job():
            stop = subprocess.run([sys.executable, "-m", "elastic_zero.cli", "stop", "goodput", "--address",
                                   cluster.head.gcs_address], env=cluster.head.client_env(), capture_output=True,
                                  text=True, timeout=120)
            if stop.returncode != 0:
                raise RuntimeError(f"elastic-zero stop failed: {stop.stderr.strip()[-500:]}")

        try:
            events_path = os.path.join(work_dir, "out", "events.jsonl")
            origin = (lambda: launched_at) if clock == "launch" else (lambda: _elastic_zero_first_step(events_path))
            played = run_schedule(schedule, _player(cluster, stop_job), lambda: driver.poll() is not None, origin)
            rc = _wait(driver)
            wall = time.time() - launched_at
        finally:
            if driver.poll() is None:  # the schedule failed: the job goes with its cluster
                driver.kill()
    finally:
        cluster.stop()
    summary_path = os.path.join(work_dir, "out", "summary.json")
    if not os.path.exists(summary_path):
        return {"rc": rc, "wall_s": round(wall, 1), "played": played, "error": f"no summary; see {work_dir}"}
    summary = json.load(open(summary_path))
    events = read_events(os.path.join(work_dir, "out"))
    return {"rc": rc, "error": summary.get("error"), "wall_s": round(wall, 1), "played": played,
            **elastic_zero_figures(summary, events, launched_at, wall)}


def _ray_train(preset: str, schedule, checkpoint_every: int, work_dir: str, clock: str, autoscaled: bool = False) -> dict:
    log, stop_file = os.path.join(work_dir, "steps.jsonl"), os.path.join(work_dir, "stop")
    job = {"min_workers": 1, "max_workers": WORKERS_AUTOSCALED if autoscaled else WORKERS,
           "storage": os.path.join(work_dir, "ray_train"), "name": "bench-goodput",
           "label_selector": spot_labels() if autoscaled else None,
           "config": {"preset": preset, "steps": 1000000, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                      "checkpoint_every": checkpoint_every, "log": log, "stop_file": stop_file, "preemption": True}}
    cluster = AutoscaledCluster() if autoscaled else BenchCluster()
    try:
        job["address"] = cluster.head.gcs_address
        with open(os.path.join(work_dir, "job.json"), "w") as fh:
            json.dump(job, fh)
        launched_at = time.time()
        with open(os.path.join(work_dir, "driver.log"), "w") as out:
            driver = subprocess.Popen([sys.executable, "-m", "elastic_zero.bench.ray_train_job", "job.json"],
                                      cwd=work_dir, env=cluster.head.client_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            origin = (lambda: launched_at) if clock == "launch" else (lambda: (_first_line(log) or {}).get("done"))
            def stop_job():
                open(stop_file, "w").close()

            played = run_schedule(schedule, _player(cluster, stop_job), lambda: driver.poll() is not None, origin)
            rc = _wait(driver)
            wall = time.time() - launched_at
        finally:
            if driver.poll() is None:
                driver.kill()
    finally:
        cluster.stop()
    records = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    return {"rc": rc, "error": None if rc == 0 else f"the driver exited {rc}; see {work_dir}/driver.log",
            "wall_s": round(wall, 1), "played": played, **ray_train_figures(records, GLOBAL_BATCH, launched_at, wall)}


def _wait(driver: subprocess.Popen, timeout_s: float = 300) -> int:
    try:
        return driver.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        driver.kill()
        return driver.wait()


def goodput_systems(systems: str | None, against: str | None) -> tuple[str, ...]:
    """The systems the command line names: `--systems` as a list, or `--against PEER` (ours and
    that peer), not both; neither is ours against Ray Train."""
    peers = {"ray-train": "ray_train", "torchft": "torchft"}
    if systems is not None and against is not None:
        raise ValueError("bench goodput: give --systems or --against, not both")
    if against is not None:
        if against not in peers:
            raise ValueError(f"bench goodput: --against: got {against!r}; allowed: {', '.join(peers)}")
        return ("elastic_zero", peers[against])
    if not systems:
        return DEFAULT_SYSTEMS
    return tuple(dict.fromkeys(s.strip() for s in systems.split(",") if s.strip()))


def run_goodput_bench(preset: str = "gpt-small", window_s: float = 600.0, seed: int = 0, notice_s: float = 30.0,
                      checkpoint_every: int = 20, systems=DEFAULT_SYSTEMS, work_root: str | None = None,
                      clock: str = "launch", torchft_stock_ddp_hook: bool = False, loss_file: str | None = None,
                      autoscaler: bool = False) -> dict:
    """Each system's run keeps its outputs in a directory of its own (under `work_root` if given).
    `clock`: the schedule counts from each job's launch, or ("first_step") from its first step.
    `torchft_stock_ddp_hook`: torchft with its DDP comm hook as released (see bench/torchft_job.py).
    `loss_file`: a Python file whose `loss(model, batch)` elastic_zero's job trains with (the short
    test's paces its steps, so that the job leaves the CPU to the tests beside it). `autoscaler`: the
    autoscaled schedule, on clusters whose nodes Ray's autoscaler starts (goodput_autoscaled.py)."""
    from elastic_zero.models import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if clock not in ("launch", "first_step"):
        raise ValueError(f"clock must be 'launch' or 'first_step', got {clock!r}")
    if loss_file is not None and not (loss_file.endswith(".py") and os.path.isfile(loss_file)):
        raise ValueError(f"loss_file must be an existing .py file, got {loss_file!r}")
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; allowed: {', '.join(SYSTEMS)}")
    if autoscaler and "torchft" in systems:
        raise ValueError("bench goodput: --autoscaler plays to elastic_zero and ray_train; torchft's replica "
                         "groups are processes of this machine, not Ray nodes")
    if "torchft" in systems:
        from elastic_zero.bench.torchft_cluster import MISSING, torchft_installed

        if not torchft_installed():
            raise ValueError(f"bench goodput: {MISSING}")
    schedule = (autoscaled_schedule if autoscaler else goodput_schedule)(window_s, seed, notice_s)
    report: dict = {"preset": preset, "window_s": window_s, "seed": seed, "notice_s": notice_s, "clock": clock,
                    "autoscaler": autoscaler,
                    "checkpoint_every": checkpoint_every, "loss_file": loss_file,
                    "schedule": [{"at_s": e.at_s, "action": e.action, "node": e.replaced_by or e.node} for e in schedule]}
    from elastic_zero.bench.goodput_torchft import play_to_torchft

    runners = {"elastic_zero": _elastic_zero, "ray_train": _ray_train, "torchft": play_to_torchft}
    extra = {"torchft": {"stock_ddp_hook": torchft_stock_ddp_hook},
             "elastic_zero": {"loss_file": loss_file, "autoscaled": autoscaler}, "ray_train": {"autoscaled": autoscaler}}
    for name in systems:
        work_dir = tempfile.mkdtemp(prefix=f"ez-goodput-{name}-", dir=work_root)
        report[name] = runners[name](preset, schedule, checkpoint_every, work_dir, clock, **extra.get(name, {}))
        report[name]["work_dir"] = work_dir
    return report


def format_goodput(r: dict) -> str:
    where = (f"{WORKERS_AUTOSCALED} workers on the autoscaler's nodes of 1" if r.get("autoscaler") else
             f"{WORKERS} workers on nodes of {CPUS_PER_NODE}")
    lines = [f"bench goodput: {r['preset']}, {where}, window {r['window_s']:g} s, "
             f"seed {r['seed']}, checkpoint every {r['checkpoint_every']} steps",
             "  schedule: " + ", ".join(f"{e['at_s']:g} s {e['action']}" + (f" {e['node']}" if e["node"] else "")
                                       for e in r["schedule"]),
             f"  {'':14s}{'goodput':>8s}{'wall s':>8s}{'in steps s':>11s}{'steps':>7s}{'redone':>7s}"
             f"{'restarts':>9s}{'samples':>9s}{'kept':>8s}{'kept/s':>8s}{'1st step s':>11s}{'step s':>8s}"]
    for name in SYSTEMS:
        if name not in r:
            continue
        m = r[name]
        if "goodput" not in m:
            lines.append(f"  {name:14s} failed: {m['error']}")
            continue
        lines.append(f"  {name:14s}{m['goodput']:8.3f}{m['wall_s']:8.1f}{m['productive_s']:11.1f}{m['steps_kept']:7d}"
                     f"{m['steps_redone']:7d}{m['restarts']:9d}{m['samples_trained']:9d}{m['samples_kept']:8d}"
                     f"{m['useful_samples_per_s']:8.1f}"
                     f"{m['first_step_done_s'] if m['first_step_done_s'] is not None else float('nan'):11.1f}"
                     f"{m['step_s_median'] if m['step_s_median'] is not None else float('nan'):8.3f}")
        lines.append(f"  {'':14s}world sizes [step, size]: {m['world_sizes']}"
                     + (f"; samples of lost or healing groups skipped: {m['skipped_samples']}"
                        if m["skipped_samples"] else "")
                     + (f"; replica groups started: {m['groups_started']}, DDP hook {m['ddp_hook']}"
                        if "groups_started" in m else "")
                     + (f"; ended with an error: {m['error']}" if m["error"] else ""))
        if m.get("steady"):  # (in steady_rates' order: the largest size first)
            lines.append(f"  {'':14s}steady state by world size: " + "; ".join(
                f"{size}: {r['samples_per_s']:.1f} samples/s, a step every {r['step_s']:.3f} s"
                for size, r in m["steady"].items()))
    return "\n".join(lines)
