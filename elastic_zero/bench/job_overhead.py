"""`elastic-zero bench overhead`: the job's step against the bare engine's, the same model, batch and
world size on the same machine, side by side in one run, and where the cores went meanwhile.

The bare engine is `bench step`'s (local gloo ranks, one torch thread each, no Ray). The job is the
same model as an elastic_zero job on an embedded local Ray, with its defaults (replicas "auto"),
and again without replicas (`replicate_every = 0`). Rounds alternate the three so that drift on a
shared machine hits them alike. Each one's median step is over its steps after the warm-up; its CPU
is read between two snapshots of every process (process_cpu.py), taken once the warm-up is done and
again a quarter of its steps before its end, and split into its workers (or ranks), the job's own side processes
(coordinator, driver, beat processes, beat drain, rendezvous relay), Ray's, the rest and idle.

Where the training's processes outnumber the cores (four workers on two), whatever the side processes
take comes out of the step: the CPU a step a worker tells the work apart from the cores it got.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

from elastic_zero.bench.process_cpu import GROUPS, cpu_shares, snapshot

ENGINE, JOB, JOB_NO_REPLICAS = "bare engine", "job", "job, no replicas"
VARIANTS = (ENGINE, JOB, JOB_NO_REPLICAS)
ENGINE_MARKER, WORKER_MARKER = "multiprocessing.forkserver", "ray::TrainingWorker"
POLL_S = 0.25  # how often the window's watcher reads the step reached (the status record is rewritten each second)
MIN_WINDOW_S = 2.0  # a shorter window says little (the kernel counts CPU in 10 ms ticks): no shares from it


class _Window:
    """Two snapshots of the machine's CPU, taken by a thread when `reached()` (a step number, -1 before
    any) first passes `start` and then `end`; the time and the steps reached at each go with them."""

    def __init__(self, reached, start: int, end: int) -> None:
        self._reached, self._marks = reached, (start, end)
        self.snaps: list = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cpu-window", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for mark in self._marks:
            while not self._done.is_set():
                step = self._reached()
                if step >= mark:
                    self.snaps.append((time.time(), step, snapshot()))
                    break
                self._done.wait(POLL_S)

    def close(self) -> None:
        self._done.set()
        self._thread.join()


def _window_end(warmup: int, steps: int) -> int:
    """The step the window closes at: a quarter of the timed steps before the end, so that it closes while
    every worker still trains (a job's status record, which tells its step, is up to a second old)."""
    return warmup + steps - max(4, steps // 4)


def _read_step(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def _status_step(job_id: str):
    """() -> the step in the job's published status record (-1 before there is one), read from the
    embedded Ray's log directory (coordinator/status_file.py). `job_id` is one no job of this Ray had."""
    import json

    from ray._private.worker import global_worker
    from elastic_zero.observe.live import status_file_name

    path = os.path.join(global_worker.node.get_logs_dir_path(), status_file_name(job_id))

    def reached() -> int:
        try:
            with open(path) as f:
                return int(json.load(f).get("step") or -1)
        except (OSError, ValueError, TypeError, AttributeError):  # none yet, half written, or not a record
            return -1

    return reached


def _engine_rank(ctx, preset: str, stage: int, micro_batch: int, warmup: int, steps: int, mark_path: str) -> list:
    """`bench step`'s trainer for one rank: `warmup` steps, then `steps` timed; rank 0 writes the
    steps done to `mark_path` as it goes (the window's watcher reads it)."""
    import torch.distributed as dist

    from elastic_zero.bench.baselines import default_group
    from elastic_zero.bench.step import _Trainer
    from elastic_zero.data import MarkovTokens
    from elastic_zero.models import PRESETS
    from elastic_zero.zero.host_memory import building

    with default_group(ctx, "bench-overhead/"):
        cfg = PRESETS[preset]
        data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
        with building():
            trainer = _Trainer(str(stage), preset, ctx.process_group)
        dist.barrier()
        stamps = []
        for i in range(warmup + steps):
            start = (i * ctx.world_size + ctx.rank) * micro_batch
            x, y = data.batch(range(start, start + micro_batch))
            if i >= warmup:
                stamps.append(time.perf_counter())
            trainer.step(x, y)
            if ctx.rank == 0:
                with open(mark_path, "w") as f:
                    f.write(str(i + 1))
        trainer.finish()
        stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]


def _engine(workers: int, preset: str, stage: int, micro_batch: int, warmup: int, steps: int, work: str) -> dict:
    from elastic_zero.testing.local_group import run_local_group

    mark = os.path.join(work, "engine-steps")
    if os.path.exists(mark):
        os.unlink(mark)
    window = _Window(lambda: _read_step(mark), warmup, _window_end(warmup, steps))
    try:
        times = run_local_group(_engine_rank, workers, (preset, stage, micro_batch, warmup, steps, mark),
                                timeout_s=3600)[0]
    finally:
        window.close()
    return {"times": times, **_cpu(window, ENGINE_MARKER, workers)}


def _job(workers: int, preset: str, stage: int, micro_batch: int, warmup: int, steps: int, work: str,
         replicate_every, name: str) -> dict:
    from elastic_zero.api import RunConfig, run
    from elastic_zero.job.spec import spec_from_dict

    spec = spec_from_dict({
        "name": name,
        "model": {"preset": preset},
        "train": {"steps": warmup + steps, "global_batch": workers * micro_batch, "micro_batch": micro_batch},
        "zero": {"stage": stage},
        "elastic": {"workers": workers, "min_workers": workers, "max_workers": workers,
                    "replicate_every": replicate_every},
    })
    window = _Window(_status_step(name), warmup, _window_end(warmup, steps))
    try:
        result = run(spec, RunConfig(run_dir=os.path.join(work, name), progress=False))
    finally:
        window.close()
    if not result.ok:
        raise RuntimeError(f"bench overhead: the job {name} failed: {result.error}")
    times = [t for step, t in result.metrics["step_time_curve"] if step >= warmup]
    # the status record's step was up to a second old when read: the steps in the window by when each ended
    ends = [at for _, at in result.metrics["step_end_curve"]]
    if window.snaps and ends and window.snaps[-1][0] > ends[-1]:  # read after the last step: its workers going
        window.snaps.pop()
    return {"times": times, "replicas": result.metrics.get("replicas"), **_cpu(window, WORKER_MARKER, workers, ends)}


def _cpu(window: _Window, marker: str, workers: int, step_ends: list | None = None) -> dict:
    """The window's CPU shares, and the CPU a step a worker; None for both where the window did not close
    (the run ended before its second snapshot) or lasted under MIN_WINDOW_S. `step_ends`: when each step
    ended (time.time()), where the steps the window saw are counted by them."""
    none = {"cpu": None, "cpu_s_per_step_per_worker": None}
    if len(window.snaps) < 2 or window.snaps[1][0] - window.snaps[0][0] < MIN_WINDOW_S:
        return none
    (t0, s0, before), (t1, s1, after) = window.snaps
    steps = sum(t0 < at <= t1 for at in step_ends) if step_ends is not None else s1 - s0
    if steps < 1:
        return none
    shares = cpu_shares(before, after, marker)
    return {"cpu": shares, "window_s": round(t1 - t0, 2),
            "cpu_s_per_step_per_worker": round(shares["workers"] / 100 * (t1 - t0) / steps / workers, 4)}


def run_overhead_bench(workers: int = 4, preset: str = "gpt-small", stage: int = 2, micro_batch: int = 4,
                       warmup: int = 5, steps: int = 60, rounds: int = 2, work_root: str | None = None) -> dict:
    if workers < 1 or micro_batch < 1 or warmup < 1 or steps < 10 or rounds < 1 or stage not in (1, 2, 3):
        raise ValueError("bench overhead: need --workers >= 1, --micro-batch >= 1, --warmup >= 1, --steps >= 10, "
                         "--rounds >= 1 and --stage 1, 2 or 3")
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE

    work = tempfile.mkdtemp(prefix="bench-overhead-", dir=work_root)
    tag = os.path.basename(work).rsplit("-", 1)[-1]  # job ids of their own: a Ray used before keeps old records
    own_ray = not ray.is_initialized()
    if own_ray:  # as the driver's embedded Ray (driver.py), started once for every round
        ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False, namespace=NAMESPACE,
                 logging_level="ERROR", log_to_driver=False)
    runs: dict = {v: [] for v in VARIANTS}
    try:
        for r in range(rounds):
            args = (workers, preset, stage, micro_batch, warmup, steps, work)
            runs[ENGINE].append(_engine(*args))
            runs[JOB].append(_job(*args, "auto", f"overhead-{tag}-{r}"))
            runs[JOB_NO_REPLICAS].append(_job(*args, 0, f"overhead-{tag}-{r}-no-replicas"))
    finally:
        if own_ray:
            ray.shutdown()
        if work_root is None:  # each job's run directory holds its final weights
            shutil.rmtree(work, ignore_errors=True)
    return summarize(runs, workers=workers, preset=preset, stage=stage, micro_batch=micro_batch, warmup=warmup,
                     steps=steps, rounds=rounds)


def summarize(runs: dict, **setup) -> dict:
    """Each variant's median step over its rounds' timed steps, against the engine's, and its CPU shares
    (each group's median over the rounds)."""
    engine = statistics.median([t for one in runs[ENGINE] for t in one["times"]])
    rows = {}
    for variant, ones in runs.items():
        median = statistics.median([t for one in ones for t in one["times"]])
        cpus = [one["cpu"] for one in ones if one.get("cpu")]
        row = {"median_step_s": round(median, 4), "vs_engine": round(median / engine, 4),
               "cpu_s_per_step_per_worker": _median([one.get("cpu_s_per_step_per_worker") for one in ones])}
        if cpus:
            row["cpu"] = {g: _median([c[g] for c in cpus]) for g in GROUPS}
            row["job_side_by_name"] = {name: _median([c["by_name"]["job's side"].get(name, [0.0])[0] for c in cpus])
                                       for name in sorted({n for c in cpus for n in c["by_name"]["job's side"]})}
            row["cores"] = cpus[0]["cores"]
        if ones and ones[0].get("replicas"):
            row["replicas"] = [one["replicas"] for one in ones]
        rows[variant] = row
    if JOB in rows and JOB_NO_REPLICAS in rows:  # what the replicas cost the job
        rows[JOB]["vs_no_replicas"] = round(rows[JOB]["median_step_s"] / rows[JOB_NO_REPLICAS]["median_step_s"], 4)
    return {**setup, "rows": rows}


def _median(values: list):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def format_overhead(report: dict) -> str:
    rows = report["rows"]
    cores = next((r["cores"] for r in rows.values() if "cores" in r), os.cpu_count())
    lines = [f"bench overhead: {report['preset']}, {report['workers']} workers, micro batch {report['micro_batch']}, "
             f"ZeRO-{report['stage']}, {report['steps']} timed steps after {report['warmup']}, "
             f"{report['rounds']} round(s), {cores} cores",
             f"  {'':18} {'step s':>7} {'vs engine':>9}   CPU (% of a core): {'workers':>7} {'job side':>8} "
             f"{'Ray':>5} {'other':>5} {'idle':>5} {'irq':>5}   CPU s a step a worker"]
    for variant, row in rows.items():
        cpu = row.get("cpu") or {}
        shares = " ".join(f"{cpu[g]:>{w}.1f}" if cpu.get(g) is not None else f"{'-':>{w}}"
                          for g, w in (("workers", 7), ("job's side", 8), ("ray", 5), ("other", 5), ("idle", 5),
                                       ("irq and steal", 5)))
        per_step = row.get("cpu_s_per_step_per_worker")
        per_step = f"{per_step:.3f}" if per_step is not None else "-"
        lines.append(f"  {variant:18} {row['median_step_s']:>7.3f} {row['vs_engine']:>8.3f}x   {'':18} {shares}   "
                     f"{per_step}")
    if "vs_no_replicas" in rows.get(JOB, {}):
        lines.append(f"  the job's step with its replicas: {rows[JOB]['vs_no_replicas']:.3f}x the job's without")
    for variant in (JOB, JOB_NO_REPLICAS):
        side = rows.get(variant, {}).get("job_side_by_name")
        if side:
            lines.append(f"  {variant}'s side: " + ", ".join(f"{name} {share:.2f}%" for name, share in side.items()))
        for replicas in rows.get(variant, {}).get("replicas", []):
            if replicas.get("reason"):
                lines.append(f"  {variant}: {replicas['reason']}")
    return "\n".join(lines)
