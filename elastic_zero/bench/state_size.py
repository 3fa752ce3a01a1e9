"""`elastic-zero bench state-size`: a GPT whose fp32 AdamW state is gigabytes, at ZeRO-3 on a few
workers of the embedded local Ray, through every elastic event: replica swaps, a kill and its
recovery, a scale-up, a preemption hand-off and checkpoint saves in one job; a resume of its
checkpoint at another world size in a second; an export of that one's final checkpoint. Every
process's RSS is sampled all along (memory.py's Sampler), and each event's extra peak over the steady
state just before it is held against a shard; the bytes each moved, per second, against this
machine's memcpy and loopback TCP bandwidths, measured in the same run (state_events.py reads the
events from what the jobs wrote). Linux only (/proc).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

from elastic_zero.bench.goodput_schedule import world_size_at
from elastic_zero.bench.memory import GIB, Sampler, export_peak, gpt_spec, peaks, worker_pids
from elastic_zero.bench.state_events import (change_windows, drills, extra_peaks, quiet_steps, rate_row,
                                             save_windows, start_up_extra, steady_peaks, swap_windows)
from elastic_zero.observe.event_log import read_events


def memcpy_bandwidth(nbytes: int = 256 * 2**20, rounds: int = 5) -> float:
    """Bytes per second of one tensor copy into another (the median of `rounds`)."""
    import torch

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # pages in
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def loopback_bandwidth(nbytes: int = 512 * 2**20, rounds: int = 3, chunk: int = 4 * 2**20) -> float:
    """Bytes per second of one TCP stream over 127.0.0.1 (the median of `rounds`): a sender thread,
    the receiving one timing until the last byte is in. Sockets release the GIL while they wait."""
    times = []
    for _ in range(rounds):
        server = socket.create_server(("127.0.0.1", 0))
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        payload = memoryview(bytearray(chunk))

        def send() -> None:
            for _ in range(nbytes // chunk):
                sender.sendall(payload)

        buffer, got = memoryview(bytearray(chunk)), 0
        t = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        while got < nbytes:
            got += receiver.recv_into(buffer)
        times.append(time.perf_counter() - t)
        thread.join()
        for s in (sender, receiver, server):
            s.close()
    return nbytes / statistics.median(times)


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_state_size_bench(d_model: int = 1024, layers: int = 16, heads: int = 16, vocab: int = 50257,
                         seq_len: int = 64, workers: int = 3, resume_workers: int = 2, replicate_every: int = 3,
                         steps: int = 18, global_batch: int = 6, micro_batch: int = 2, meta: bool = True,
                         workdir: str | None = None) -> dict:
    """Steps: a few with replica swaps, then a kill at a third of them and a preemption notice at two
    thirds (each followed by its replacement's joining, a scale-up), checkpoints every quarter; then
    the resumed job runs 2 more."""
    for wrong, why in ((workers < 2, f"--workers {workers}: at least 2 (a kill needs a survivor)"),
                       (not 1 <= resume_workers != workers, f"--resume-workers {resume_workers}: at least 1, and not "
                                                            f"--workers ({workers}): the resume is at another size"),
                       (replicate_every < 1, f"--replicate-every {replicate_every}: at least 1 (a swap is an event)"),
                       (steps < 12, f"--steps {steps}: at least 12 (the events come in turn)")):
        if wrong:
            raise ValueError(f"bench state-size: {why}")
    from elastic_zero.api import RunConfig, run
    from elastic_zero.checkpoint.catalog import step_of_directory

    links = {"memory": memcpy_bandwidth(), "loopback": loopback_bandwidth()}
    work = workdir or tempfile.mkdtemp(prefix="ez-bench-state-size-")
    ckpt = os.path.join(work, "ckpt")
    model = (d_model, layers, heads, vocab, seq_len, meta, 3)
    kill_at, preempt_at = steps // 3, 2 * steps // 3
    try:
        spec = gpt_spec("bench-state-size", *model, steps, global_batch, micro_batch,
                        {"workers": workers, "min_workers": 1, "replicate_every": replicate_every},
                        faults=drills(kill_at, preempt_at),
                        checkpoint={"uri": ckpt, "every": max(2, steps // 4)})
        started = time.time()
        with Sampler() as sampler:
            result = run(spec, RunConfig(run_dir=os.path.join(work, "run"), progress=False))
        if not result.ok:
            raise RuntimeError(f"bench state-size: the job failed: {result.error}")
        summary, params = result.metrics, result.metrics["param_count"]
        shard_bytes = 12 * params // workers  # master weights and AdamW's two moments of one worker's shard
        records = read_events(result.path)
        committed = [e["directory"] for e in records if e.get("event") == "checkpoint_committed"]
        saved = {d: (step, _directory_bytes(d), world_size_at(summary["world_size_history"], step - 1))
                 for d, step in ((d, step_of_directory(d)) for d in committed) if os.path.isdir(d)}
        changes = change_windows(summary)
        first_change = min((w.start for w in changes), default=float("inf"))
        windows = sorted(swap_windows(summary, replicate_every, first_change, shard_bytes) + changes
                         + save_windows(summary, records, saved), key=lambda w: w.start)
        steady = steady_peaks(sampler.samples, quiet_steps(summary, replicate_every, first_change))
        extras = extra_peaks(sampler.samples, steady, windows)
        rows = [rate_row(w.name, w.start - started, w.end - w.start, extra, shard_bytes, w.moved_bytes, w.moving_s,
                         w.link, links) for w, extra in zip(windows, extras)]
        processes = peaks(sampler.samples, started + (summary.get("time_to_first_step_s") or 0.0))

        # the same checkpoint resumed at another world size: a periodic one, not the final (nothing would be left to run)
        resume_step = max(step for step, _, _ in saved.values() if step < steps)
        again = gpt_spec("bench-state-size-resume", *model, resume_step + 2, global_batch, micro_batch,
                         {"workers": resume_workers, "replicate_every": replicate_every},
                         checkpoint={"uri": ckpt, "resume": str(resume_step)})
        started = time.time()
        with Sampler() as resumed_sampler:
            resumed = run(again, RunConfig(run_dir=os.path.join(work, "run-resumed"), progress=False))
        if not resumed.ok:
            raise RuntimeError(f"bench state-size: the resumed job failed: {resumed.error}")
        first_done = resumed.metrics["step_end_curve"][0][1]  # (sorted by step)
        resumed_samples = resumed_sampler.of_job(worker_pids(read_events(resumed.path)))
        start = resumed.metrics["start"]
        rows.append(rate_row(f"resume at {resume_workers} workers", None, first_done - started,
                             start_up_extra(resumed_samples, first_done), shard_bytes,
                             start.get("received_bytes"), start["phases_s"].get("resume"), "memory", links))
        export = export_peak(resumed.final_checkpoint, os.path.join(work, "weights.safetensors"))
        rows.append(rate_row("export (its own process)", None, export["seconds"],
                             int((export["peak_gib"] - export["imports_only_gib"]) * GIB), shard_bytes,
                             int(export["written_gib"] * GIB), export["seconds"], "memory", links))
        return {"config": {"d_model": d_model, "layers": layers, "heads": heads, "vocab": vocab, "seq_len": seq_len,
                           "workers": workers, "resume_workers": resume_workers, "replicate_every": replicate_every,
                           "steps": steps, "global_batch": global_batch, "meta": meta},
                "params": params, "adamw_state_gib": round(16 * params / GIB, 2),
                "shard_gib": round(shard_bytes / GIB, 3),
                "steady_worker_peak_gib": round(max(steady.values(), default=0) / GIB, 2),
                "export": export,
                "links_gb_per_s": {k: round(v / 1e9, 2) for k, v in links.items()},
                "step_time_s_median": summary.get("step_time_s_median"),
                "processes": processes + [dict(p, kind=f"{p['kind']} (resumed)")
                                          for p in peaks(resumed_samples, first_done)],
                "events": rows}
    finally:
        if workdir is None:  # gigabytes of checkpoints
            shutil.rmtree(work, ignore_errors=True)


def _or_dash(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def format_state_size(report: dict) -> str:
    c = report["config"]
    links = report["links_gb_per_s"]
    lines = [f"GPT d_model {c['d_model']}, {c['layers']} layers, vocab {c['vocab']}: {report['params']:,} parameters, "
             f"fp32 AdamW state {report['adamw_state_gib']:.2f} GiB; ZeRO-3 on {c['workers']} workers, replicas every "
             f"{c['replicate_every']} steps; a shard's replicated state {report['shard_gib']:.2f} GiB",
             f"links: memcpy {links['memory']:.2f} GB/s, loopback TCP {links['loopback']:.2f} GB/s; "
             f"median step {report['step_time_s_median']:.2f} s; a worker's steady peak (quiet steps before the first "
             f"event) {report['steady_worker_peak_gib']:.2f} GiB",
             f"{'process':<22} {'start-up':>9} {'training':>9} {'peak':>7}   (GiB of RSS)"]
    for p in report["processes"]:
        lines.append(f"{p['kind']:<22} {p['start_up_gib']:>9.2f} {p['training_gib']:>9.2f} {p['peak_gib']:>7.2f}")
    width = max([26] + [len(e["event"]) for e in report["events"]])  # "scale-down hand-over (12 -> 11)"
    lines.append(f"{'event':<{width}} {'at (s)':>7} {'lasted':>7} {'extra peak':>10} {'shards':>6} {'moved':>7} "
                 f"{'in (s)':>7} {'GB/s':>6} {'link':>8} {'of link':>7}")
    for e in report["events"]:
        lines.append(f"{e['event']:<{width}} {_or_dash(e['at_s']):>7} {_or_dash(e['seconds']):>7} "
                     f"{_or_dash(e['extra_peak_gib'], '.3f'):>10} {_or_dash(e['of_a_shard']):>6} "
                     f"{_or_dash(e['moved_gib']):>7} {_or_dash(e['moving_s']):>7} {_or_dash(e['gb_per_s']):>6} "
                     f"{e['link'] or '-':>8} {_or_dash(e['of_link']):>7}")
    lines.append("extra peak: GiB over the worker's steady peak (-: no sample fell within the event); shards: that "
                 "over a shard's replicated state at the starting size; moved: GiB the busiest worker took in (a "
                 "save: wrote; a swap: sent), in the seconds after it (a swap: the seconds training waited for it)")
    return "\n".join(lines)
