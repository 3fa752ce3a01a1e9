"""`elastic-zero bench memory`: every process's peak RSS through one job of a GPT of real size on the
embedded local Ray, by phase, against the engine's own state; and the peak of exporting its final
weights (memory through the elastic events is `bench state-size`, state_size.py). The job's workers,
its coordinator and this driver are read from /proc every 0.1 s (Ray names a worker's process after
its actor's class), so what is measured is the whole process, not what the engine reports of itself.

Phases of a worker: start-up (to the job's first step: the model built, the engine made) and
training (the steps, the replicas, the final checkpoint written). The GPT is our own (nanoGPT's
shape, a tied head); built under meta_init() with `--meta`, its parameters get their values unit by
unit (torch's own initializations). Linux only (/proc).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from elastic_zero.observe.event_log import read_events

GIB = 2**30
_KINDS = (("TrainingWorker", "worker"), ("Coordinator", "coordinator"))


def gpt_on_meta(**config):
    """The GPT preset's model with its parameters on the meta device (a factory the bench ships)."""
    from elastic_zero.models import build_preset
    from elastic_zero.zero.meta import meta_init

    with meta_init():
        return build_preset("gpt-small", **config)


def processes_below(driver_pid: int, high_water: dict | None = None) -> dict[int, tuple[str, int]]:
    """{pid: (kind, rss bytes)} of the driver and of the Ray actors below it (its embedded Ray's
    raylet is its child): another Ray on the machine, with actors of the same names, is not counted.
    `high_water`: filled with each one's exact peak RSS so far, which a sample every 0.1 s can miss (a
    backward's peak lasts a fraction of a second): the most of its VmHWM and VmRSS ever read. Not the
    last VmHWM alone: the kernel moves its high-water mark only at some events (an unmap, the exit),
    and memory handed back otherwise (an allocator's madvise) leaves a later VmHWM below an earlier
    VmRSS (a memory check failed so: 0.63 GiB sampled, 0.62 read after)."""
    parent, names = {}, {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            pid = int(d[6:])
            parent[pid] = int(open(f"{d}/stat").read().rsplit(")", 1)[1].split()[1])
            names[pid] = open(f"{d}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile

    def below_driver(pid: int) -> bool:
        for _ in range(64):
            if pid == driver_pid:
                return True
            pid = parent.get(pid, 0)
            if pid <= 1:
                return False
        return False

    out = {}
    for pid, name in names.items():
        try:
            kind = "driver" if pid == driver_pid else next((k for cls, k in _KINDS if name.startswith(f"ray::{cls}")), None)
            if kind is None or not below_driver(pid):
                continue
            d = f"/proc/{pid}"
            status = {line.split(":", 1)[0]: line for line in open(f"{d}/status")
                      if line.startswith(("VmRSS:", "VmHWM:"))}
            rss = int(status["VmRSS"].split()[1]) * 1024
            out[pid] = (kind, rss)
            if high_water is not None:  # the kernel's VmHWM lags (see the docstring): the most ever read
                high_water[pid] = max(high_water.get(pid, 0), rss, int(status["VmHWM"].split()[1]) * 1024)
        except (OSError, ValueError, StopIteration, KeyError):
            continue  # gone meanwhile
    return out


class Sampler:
    """Samples every process of this driver's job (`processes_below`) every 0.1 s on a thread, while
    in its `with` block: `samples` is [(epoch seconds, {pid: (kind, rss bytes)})]. Actors there before
    the block are not the job's: in a Ray the driver reuses, an earlier job's may still be exiting."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.samples: list[tuple[float, dict]] = []
        self.high_water: dict[int, int] = {}  # pid -> the most VmHWM or VmRSS read: the exact peak of its life
        self._period_s, self._stop = period_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._before: set[int] = set()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = processes_below(os.getpid(), self.high_water)
            self.samples.append((time.time(), {pid: v for pid, v in now.items() if pid not in self._before}))
            self._stop.wait(self._period_s)

    def __enter__(self) -> "Sampler":
        self._before = set(processes_below(os.getpid())) - {os.getpid()}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def of_job(self, worker_pids: set[int]) -> list[tuple[float, dict]]:
        """The samples with only this job's workers, those its events name (`worker_ready`): a worker
        of an earlier job on the same Ray that Ray started after all (its spawn cancelled by that
        job's end, seen in CI) is not this job's. A job may end within one sampling period of its
        first step, so being alive then does not tell them apart (seen in CI too)."""
        return [(at, {pid: v for pid, v in procs.items() if v[0] != "worker" or pid in worker_pids})
                for at, procs in self.samples]


def worker_pids(records: list[dict]) -> set[int]:
    """The processes of a job's workers, as its events name them."""
    return {e["pid"] for e in records if e.get("event") == "worker_ready" and e.get("pid")}


def run_memory_bench(d_model: int = 1024, layers: int = 24, heads: int = 16, vocab: int = 50257, seq_len: int = 64,
                     workers: int = 2, stage: int = 3, replicate_every: int = 0, meta: bool = False, steps: int = 3,
                     global_batch: int = 4, micro_batch: int = 2, workdir: str | None = None,
                     memory_per_node_gib: float | None = None) -> dict:
    if workers < 1 or steps < 1 or stage not in (1, 2, 3) or replicate_every < 0:
        raise ValueError("need workers >= 1, steps >= 1, stage 1-3 and replicate_every >= 0")
    if memory_per_node_gib is not None and not memory_per_node_gib > 0:
        raise ValueError(f"--memory-per-node-gib: must be > 0, got {memory_per_node_gib}")
    from elastic_zero.api import RunConfig, run

    work = workdir or tempfile.mkdtemp(prefix="ez-bench-memory-")
    try:
        spec = gpt_spec("bench-memory", d_model, layers, heads, vocab, seq_len, meta, stage, steps, global_batch,
                        micro_batch, {"workers": workers, "replicate_every": replicate_every,
                                      "memory_per_node_gib": memory_per_node_gib})
        started = time.time()
        with Sampler() as sampler:
            result = run(spec, RunConfig(run_dir=os.path.join(work, "run"), progress=False))
        if not result.ok:
            raise RuntimeError(f"bench memory: the job failed: {result.error}")
        first_step = started + (result.metrics.get("time_to_first_step_s") or 0.0)
        params = result.metrics["param_count"]
        return {"config": {"d_model": d_model, "layers": layers, "heads": heads, "vocab": vocab, "seq_len": seq_len,
                           "workers": workers, "stage": stage, "replicate_every": replicate_every, "meta": meta,
                           "steps": steps, "global_batch": global_batch},
                "params": params, "engine_state_per_worker_gib": round(16 * params / workers / GIB, 3),
                "step_time_s_median": result.metrics.get("step_time_s_median"),
                # the job's own workers only: Ray may start a worker process it then does not use
                "processes": peaks(sampler.of_job(worker_pids(read_events(result.path))), first_step, sampler.high_water),
                "plan": result.metrics.get("memory", {}).get("plan"), "warnings": result.metrics.get("warnings", []),
                "export": export_peak(result.final_checkpoint, os.path.join(work, "weights.safetensors")),
                "export_pt": export_peak(result.final_checkpoint, os.path.join(work, "weights.pt"), "torch")}
    finally:
        if workdir is None:  # the checkpoints of a model of real size: gigabytes
            shutil.rmtree(work, ignore_errors=True)


def gpt_spec(name: str, d_model: int, layers: int, heads: int, vocab: int, seq_len: int, meta: bool, stage: int,
             steps: int, global_batch: int, micro_batch: int, elastic: dict, **sections):
    """The job spec of the bench's GPT (our preset, a tied head) on synthetic tokens."""
    from elastic_zero.job.spec import spec_from_dict

    config = dict(vocab_size=vocab, seq_len=seq_len, n_layer=layers, n_head=heads, d_model=d_model, tied_head=True)
    model = {"factory": gpt_on_meta, "kwargs": config} if meta else {"preset": "gpt-small", "kwargs": config}
    return spec_from_dict({
        "name": name, "model": model, "zero": {"stage": stage},
        "data": {"source": "synthetic", "seq_len": seq_len, "vocab_size": vocab},
        "train": {"steps": steps, "global_batch": global_batch, "micro_batch": micro_batch},
        "elastic": {"min_workers": elastic["workers"], "max_workers": elastic["workers"], "join_window_s": 0.0,
                    "collective_timeout_s": 600.0, **elastic}, **sections})


def peaks(samples, first_step: float, high_water: dict | None = None) -> list[dict]:
    """Each process's peak RSS (GiB) before the first step, after it, and in all, as sampled; and
    its exact peak (the most VmHWM or VmRSS read: processes_below) where `high_water` has it."""
    by_pid: dict[int, dict] = {}
    for t, procs in samples:
        for pid, (kind, rss) in procs.items():
            p = by_pid.setdefault(pid, {"kind": kind, "start_up": 0, "training": 0})
            p["start_up" if t < first_step else "training"] = max(p["start_up" if t < first_step else "training"], rss)
    out = []
    for pid, p in sorted(by_pid.items(), key=lambda item: (item[1]["kind"], item[0])):
        out.append({"kind": p["kind"], "pid": pid, "start_up_gib": round(p["start_up"] / GIB, 2),
                    "training_gib": round(p["training"] / GIB, 2),
                    "peak_gib": round(max(p["start_up"], p["training"]) / GIB, 2),
                    "exact_peak_gib": round(high_water[pid] / GIB, 2) if high_water and pid in high_water else None})
    return out


def export_peak(checkpoint: str, out: str, fmt: str = "safetensors") -> dict:
    """`elastic-zero export` of the final checkpoint (to safetensors, or `fmt`) in a process of its
    own: its RSS once it has imported what export imports, its exact peak after (VmHWM, reset once
    the imports are done: an import's own spike does not hide what the export holds), the bytes
    written and the seconds."""
    script = ("import os, sys, time; from elastic_zero.checkpoint.export import export;"
              "from elastic_zero.node_memory import peak_rss_bytes, reset_peak, rss_bytes;"
              "imported = rss_bytes(os.getpid()); reset_peak(); t = time.perf_counter();"
              "export(sys.argv[1], sys.argv[2], sys.argv[3]);"
              "print(imported, peak_rss_bytes(os.getpid()), time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", script, checkpoint, out, fmt], capture_output=True, text=True, check=True)
    imported, peak, seconds = done.stdout.split()
    written = os.path.getsize(out)
    os.remove(out)
    return {"peak_gib": round(int(peak) / GIB, 3), "imports_only_gib": round(int(imported) / GIB, 3),
            "written_gib": round(written / GIB, 3), "seconds": round(float(seconds), 2)}


def format_memory(report: dict) -> str:
    c = report["config"]
    lines = [f"GPT d_model {c['d_model']}, {c['layers']} layers, vocab {c['vocab']}: {report['params']:,} parameters; "
             f"ZeRO-{c['stage']} on {c['workers']} workers, replicate_every {c['replicate_every']}, built "
             f"{'on the meta device' if c['meta'] else 'for real'}; {c['steps']} steps of {c['global_batch']} x "
             f"{c['seq_len']} tokens",
             f"engine state per worker (16 bytes per parameter of its shard): {report['engine_state_per_worker_gib']:.2f} GiB",
             f"{'process':<12} {'start-up':>9} {'training':>9} {'peak':>7} {'exact peak':>11}   (GiB of RSS: sampled "
             f"every 0.1 s; exact: VmHWM)"]
    for p in report["processes"]:
        exact = f"{p['exact_peak_gib']:>11.2f}" if p.get("exact_peak_gib") is not None else f"{'-':>11}"
        lines.append(f"{p['kind']:<12} {p['start_up_gib']:>9.2f} {p['training_gib']:>9.2f} {p['peak_gib']:>7.2f} {exact}")
    plan = report.get("plan")
    if plan:
        lines.append(f"the plan's memory: {plan['workers']} workers, replicas {'kept' if plan['replicas'] else 'none'}; "
                     f"a worker's need {plan['need_gib']:.2f} GiB (engine {plan['engine_gib']:.2f}, replicas "
                     f"{plan['replicas_gib']:.2f}, beside the state {plan['beside_state_gib']:.2f}), room {plan['room_gib']:.2f} GiB")
    lines += [f"warning: {w}" for w in report.get("warnings", ())]
    for key, name in (("export", "safetensors"), ("export_pt", "a torch .pt")):
        e = report[key]
        lines.append(f"export to {name}: peak {e['peak_gib']:.2f} GiB (the interpreter with its imports "
                     f"{e['imports_only_gib']:.2f}), {e['written_gib']:.2f} GiB written in {e['seconds']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - `elastic-zero bench memory` is the way in
    print(json.dumps(run_memory_bench()))
