"""`elastic-zero bench gpu`: what the runtime costs beside the math, on one device, side by side in
one run, for each model shape:

- torch alone (bf16 autocast and fused AdamW on CUDA; fp32 and AdamW on the CPU): one step's median;
- the bare ZeroEngine at stages 1, 2 and 3 (world size 1, the job's compute dtype), and at stage 2
  with its host copy each step (step(host_copy=True), take_host_copy(): what a replica costs the step);
- the same model as a job on the embedded Ray (one worker, use_gpu on CUDA, no replicas, no
  checkpoints): its median step, and its first step by phase;
- the job with replicas every step, and at the default cadence ("auto": the cadence and why);
- the job with a checkpoint every few steps that loses its worker once: the blocking seconds of
  each save, the steps while a save writes, and the recovery from the checkpoint by phase (by a
  standby worker where a second device is there for one, as on the CPU; there, once more without
  one, as on one GPU: the recovery then waits for a new worker's start, told by phase).

Without CUDA it runs the same on tiny shapes on the CPU, and says so: the absolute times then mean
nothing, the ratios move the way they move on a GPU (CI runs it so). On a GPU machine without a
package registry, ../shared/gpu/README.md (outside the repository) shows how to bring Ray there.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

SHAPES = {  # GPT-2's, built from the gpt-small preset with these overrides; "tiny": for the CPU
    "124m": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768, tied_head=True),
    "355m": dict(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024, tied_head=True),
    "small": dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256, tied_head=True),  # the CPU's figures
    "tiny": dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64, tied_head=True),  # CI's
}


def _standby_devices() -> int:
    """1 where a standby worker has a device of its own (a second GPU, or the CPU), else 0."""
    import torch

    return 1 if not _cuda() or torch.cuda.device_count() > 1 else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step, count: int) -> list[float]:
    """The seconds of `count` calls of `step()`, each ended by a device sync."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - started)
    return times


def _bare(shape: dict, micro_batch: int, steps: int, warmup: int, rounds: int = 3) -> dict:
    """torch alone, and the bare engine at each stage (and stage 2 with its host copy), in this
    process, one torch thread as in a worker; in rounds that alternate them, so that drift on a
    shared machine hits them alike, the median over every timed step of each."""
    import torch

    cuda = _cuda()
    device = torch.device("cuda" if cuda else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens = torch.randint(0, shape["vocab_size"], (micro_batch, shape["seq_len"] + 1), device=device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    variants = {"torch_step_s": (_torch_step(shape, device, batch), None)}
    for stage, host_copy in ((1, False), (2, False), (3, False), (2, True)):
        name = "engine_host_copy_step_s" if host_copy else f"engine_stage{stage}_step_s"
        variants[name] = _engine_step(shape, device, batch, stage, host_copy)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for name, (step, _) in variants.items():
            _timed(step, warmup)
        for r in range(rounds):
            for name, (step, _) in variants.items():
                times[name] += _timed(step, max(1, steps // rounds))
    finally:
        for _, close in variants.values():
            if close is not None:
                close()
        torch.set_num_threads(threads)
    if cuda:
        torch.cuda.empty_cache()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _torch_step(shape: dict, device, batch):
    """One step of plain torch: bf16 autocast and fused AdamW on CUDA, fp32 on the CPU."""
    import torch

    from elastic_zero.models import build_preset, lm_loss

    cuda = device.type == "cuda"
    model = build_preset("gpt-small", seed=0, **shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x, y = batch

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _engine_step(shape: dict, device, batch, stage: int, host_copy: bool):
    """(one step of the bare engine, its close): with `host_copy`, the copy a replica's commit takes."""
    import torch

    from elastic_zero.models import build_preset, lm_loss
    from elastic_zero.zero import AdamW, ZeroEngine

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = ZeroEngine(build_preset("gpt-small", seed=0, **shape).to(device), AdamW(lr=1e-4), stage=stage,
                        compute_dtype=dtype, device=device)
    x, y = batch

    def step():
        engine.backward(lm_loss(engine.module(x), y))
        engine.step(host_copy=host_copy)
        engine.zero_grad()
        if host_copy:  # complete, as the commit waits for it
            taken = engine.take_host_copy()
            if taken is not None and taken[1] is not None:
                taken[1].synchronize()

    return step, engine.close


def _job(name: str, shape: dict, micro_batch: int, steps: int, work: str, keep_runs: bool, **sections) -> dict:
    """One job of the shape on the embedded (or the connected) Ray: its summary and events. Its run
    dir (`work/name`: its final weights, its checkpoints) goes once read, unless `keep_runs` (a
    failed job's stays): every job writes its final checkpoint, about 4 GB of 355M's state (the
    checkpointing jobs two more), and a lent GPU's disk is 64 GB."""
    from elastic_zero.api import RunConfig, run
    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.observe.event_log import read_events

    cuda = _cuda()
    data = {
        "name": name,
        "model": {"preset": "gpt-small", "kwargs": dict(shape)},
        "data": {"source": "synthetic", "seq_len": shape["seq_len"], "vocab_size": shape["vocab_size"]},
        "train": {"steps": steps, "global_batch": micro_batch, "micro_batch": micro_batch},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "zero": {"stage": 2, "compute_dtype": "bfloat16" if cuda else "float32"},
        "elastic": {"workers": 1, "min_workers": 1, "max_workers": 1, "use_gpu": cuda, "replicate_every": 0},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    result = run(spec_from_dict(data), RunConfig(run_dir=os.path.join(work, name), progress=False))
    if not result.ok:
        raise RuntimeError(f"bench gpu: the job {name} failed (its outputs: {os.path.join(work, name)}): "
                           f"{result.error}")
    done = {"summary": result.metrics, "events": read_events(result.path)}
    if not keep_runs:
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    return done


def _steady(summary: dict, skip: int = 2) -> float | None:
    """The median step of a job, its first `skip` steps (warm-up) aside."""
    times = [t for step, t in summary["step_time_curve"] if step >= skip]
    return statistics.median(times) if times else None


def _jobs(shape: dict, micro_batch: int, steps: int, save_every: int, work: str, row: dict, kept,
          steady: bool = True, keep_runs: bool = False) -> None:
    """The jobs' figures, into `row`, kept (`kept()`) after each job; without `steady`, only the
    job with checkpoints and a recovery (the plain job's and the replicas' figures are None: CI's
    shorter run of the bench)."""
    row.update(job_step_s=None, replicas_step_s=None, auto_replicas_step_s=None, auto_cadence=None)
    plain = None
    if steady:
        plain = _job("plain", shape, micro_batch, steps, work, keep_runs)["summary"]
        row.update(job_step_s=_steady(plain), time_to_first_step_s=plain["time_to_first_step_s"],
                   first_step_phases_s=(plain.get("start") or {}).get("phases_s", {}),
                   first_worker_start_s=(plain.get("start") or {}).get("worker_start_s"))
        kept()
        replicas = _job("replicas", shape, micro_batch, steps, work, keep_runs,
                        elastic={"replicate_every": 1})["summary"]
        row["replicas_step_s"] = _steady(replicas)
        kept()
        # the default cadence: the ranks' choice from the copies' measured cost (plan/cadence.py)
        auto = _job("replicas-auto", shape, micro_batch, steps, work, keep_runs,
                    elastic={"replicate_every": "auto"})["summary"]
        row.update(auto_replicas_step_s=_steady(auto), auto_cadence=auto["replicas"])
        kept()
    # a checkpoint every `save_every` steps, and the worker killed a step after the first once that one is
    # committed (kill_after_save): the recovery from the checkpoint (one worker: no replica), then the
    # saves' blocking and the steps while one writes, in the generation that recovered (the first one's
    # report is lost with its worker). A standby worker takes its place at once where a second device is
    # there for it (on the CPU, always): the recovery waits for no worker's start
    standby = _standby_devices()

    def killed_after_save(name: str, standby_workers: int) -> dict:
        return _job(name, shape, micro_batch, steps, work, keep_runs,
                    checkpoint={"uri": os.path.join(work, name, "ckpt"), "every": save_every, "keep": 2},
                    elastic={"standby_workers": standby_workers},
                    faults=[{"at_step": save_every + 1, "action": "kill_after_save", "rank": 0}])["summary"]

    saved = killed_after_save("checkpoints", standby)
    protect = dict(saved["protect_time_curve"])
    times = dict(saved["step_time_curve"])
    saves = [s for s in protect if s > 1 and (s + 1) % save_every == 0 and s + 1 < steps]
    during = [times[s + 1] for s in saves if s + 1 in times]
    if plain is None:
        row.update(time_to_first_step_s=saved["time_to_first_step_s"],
                   first_step_phases_s=(saved.get("start") or {}).get("phases_s", {}),
                   first_worker_start_s=(saved.get("start") or {}).get("worker_start_s"))
    row.update({
        "save_blocking_s": [round(protect[s], 4) for s in saves],
        "saves_skipped": saved.get("checkpoints_skipped", []),  # due while the last was still being written
        "steps_during_write_s": [round(t, 4) for t in during],
        "recovery": _recovery(saved, standby),
        "recovery_without_standby": None,
    })
    if steady and standby:  # what one GPU sees: the recovery waits for a new worker's whole start
        kept()
        row["recovery_without_standby"] = _recovery(killed_after_save("no-standby", 0), 0)


def _recovery(summary: dict, standby: int) -> dict:
    """A job's first recovery: its stall by phase, and the start of the new worker it waited for (None
    where a standby was ready)."""
    recovery = summary["recoveries"][0] if summary["recoveries"] else {}
    return {"source": recovery.get("source"), "stall_s": recovery.get("stall_s"), "standby_workers": standby,
            "to_next_step_done_s": recovery.get("to_next_step_done_s"), "phases_s": recovery.get("phases_s", {}),
            "lost_steps": recovery.get("lost_steps"), "worker_start_s": recovery.get("worker_start_s"),
            "worker_ready_after_s": recovery.get("worker_ready_after_s")}


def run_gpu_bench(models: tuple[str, ...] | None = None, micro_batch: int | None = None, steps: int | None = None,
                  warmup: int = 3, save_every: int = 10, workdir: str | None = None, steady: bool = True,
                  partial: str | None = None, keep_runs: bool | None = None) -> dict:
    """The bench on CUDA when there is one (GPT-2 124M and 355M shapes, micro batch 8 of 1,024
    tokens), else on the CPU on tiny shapes. `steady` False: no plain job and no job with replicas.
    `partial`: a file the figures so far are written to after each measurement (a run cut short by
    a time limit, as a lent GPU's are, keeps them). `keep_runs`: whether each job's run dir stays
    (default: where `workdir` is given); without a `workdir` the bench's temp dir goes when it ends
    well (unless `keep_runs`: the report's "workdir" names it)."""
    import torch

    cuda = _cuda()
    models = models or (("124m", "355m") if cuda else ("tiny",))
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; allowed: {', '.join(SHAPES)}")
    micro_batch = micro_batch or (8 if cuda else 4)
    steps = steps or (40 if cuda else 32)
    if steps < 3 * save_every or save_every < 2:
        raise ValueError(f"--steps ({steps}) must be at least 3 x --save-every ({save_every}), and --save-every >= 2")
    device = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: tiny shapes, absolute times mean nothing)"
    work = workdir or tempfile.mkdtemp(prefix="ez-bench-gpu-")
    keep_runs = workdir is not None if keep_runs is None else keep_runs
    report = {"device": device, "torch": torch.__version__, "micro_batch": micro_batch, "steps": steps, "models": {},
              "workdir": work if keep_runs else None}

    def kept() -> None:
        if partial:
            with open(partial + ".part", "w") as f:
                json.dump(report, f)
            os.replace(partial + ".part", partial)

    import ray

    from elastic_zero.coordinator.actor import NAMESPACE

    own_ray = not ray.is_initialized()
    if own_ray:  # one Ray for every job of the bench, where each job's own would start and stop one
        ray.init(num_cpus=max(os.cpu_count() or 1, 2), namespace=NAMESPACE, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
    try:
        for name in models:
            report["models"][name] = row = {"shape": SHAPES[name]}
            _model_row(name, micro_batch, steps, warmup, save_every, work, row, kept, steady, keep_runs)
            kept()
    finally:
        if own_ray:
            ray.shutdown()
    if workdir is None and not keep_runs:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _model_row(name: str, micro_batch: int, steps: int, warmup: int, save_every: int, work: str, row: dict,
               kept, steady: bool = True, keep_runs: bool = False) -> None:
    """One shape's row, into `row`: the bare measurements, the jobs', and their ratios."""
    shape = SHAPES[name]
    row.update(_bare(shape, micro_batch, min(steps, 20), warmup))
    kept()
    _jobs(shape, micro_batch, steps, save_every, os.path.join(work, name), row, kept, steady, keep_runs)
    engine = row["engine_stage2_step_s"]
    row["ratios"] = {
        "engine_vs_torch": round(engine / row["torch_step_s"], 3),
        "host_copy_vs_engine": round(row["engine_host_copy_step_s"] / engine, 3),
        "job_vs_engine": round(row["job_step_s"] / engine, 3) if row["job_step_s"] else None,
        "replicas_vs_job": round(row["replicas_step_s"] / row["job_step_s"], 3)
        if row["replicas_step_s"] and row["job_step_s"] else None,
        "auto_replicas_vs_job": round(row["auto_replicas_step_s"] / row["job_step_s"], 3)
        if row["auto_replicas_step_s"] and row["job_step_s"] else None,
    }


def _recovery_line(rec: dict) -> str:
    return (f"  recovery from the {rec['source']}{' by a standby worker' if rec.get('standby_workers') else ''}: "
            f"stall {rec['stall_s']} s, next step done after {rec['to_next_step_done_s']} s ("
            + _seconds(rec["phases_s"]) + ")"
            + _worker_start(f"; the new worker, ready {rec.get('worker_ready_after_s')} s after the failure, started",
                            rec.get("worker_start_s")))


def _seconds(phases: dict) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())


def _worker_start(what: str, phases: dict | None) -> str:
    """A worker's start by phase (worker/start_clock.py), or nothing where none was waited for."""
    return f"{what}: {_seconds(phases)}" if phases else ""


def format_gpu(report: dict) -> str:
    lines = [f"bench gpu on {report['device']}, torch {report['torch']}, micro batch {report['micro_batch']}, "
             f"{report['steps']} steps a job"]
    for name, r in report["models"].items():
        ms = lambda s: f"{s * 1e3:.1f} ms" if s is not None else "-"  # noqa: E731
        q = r["ratios"]
        lines += [
            f"{name}: torch {ms(r['torch_step_s'])}; engine stage 1 / 2 / 3 {ms(r['engine_stage1_step_s'])} / "
            f"{ms(r['engine_stage2_step_s'])} / {ms(r['engine_stage3_step_s'])} ({q['engine_vs_torch']}x torch at "
            f"stage 2); with its host copy {ms(r['engine_host_copy_step_s'])} ({q['host_copy_vs_engine']}x)",
            f"  job {ms(r['job_step_s'])} ({q['job_vs_engine']}x the engine); with replicas every step "
            f"{ms(r['replicas_step_s'])} ({q['replicas_vs_job']}x the job); first step after "
            f"{r['time_to_first_step_s']} s ({_seconds(r['first_step_phases_s'])})"
            + _worker_start("; the last worker's start", r.get("first_worker_start_s")),
            f"  with replicas at the default cadence {ms(r['auto_replicas_step_s'])} ({q['auto_replicas_vs_job']}x "
            f"the job): {(r['auto_cadence'] or {}).get('reason') or '-'}",
            f"  saves block {', '.join(ms(s) for s in r['save_blocking_s'])}; the steps while one writes "
            f"{', '.join(ms(s) for s in r['steps_during_write_s'])}",
            _recovery_line(r["recovery"]),
        ]
        if r.get("recovery_without_standby"):
            lines.append(_recovery_line(r["recovery_without_standby"]) + " (without a standby, as on one GPU)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - `elastic-zero bench gpu` is the way in
    print(json.dumps(run_gpu_bench()))
