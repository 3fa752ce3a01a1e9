"""`elastic-zero bench pinning`: what it costs to make the pinned host buffers a worker's first host
copy of its shard goes into (its first replica's or save's), each way of making them, side by side.

On an H200 (2026-11-28) a worker's first save blocked 634 ms at GPT-2 124M and 2,340 ms at 355M, and
its next saves 0.1 ms: the first made its pinned buffers, by torch's caching host allocator, which
calls cudaHostAlloc, at about 2.2 GB/s. Making them ahead on a thread beside the steps was tried,
and no bench run with it finished: cudaHostAlloc holds CUDA's driver while it faults and locks the
pages, and a training thread's launches wait on it. The same allocator also rounds each block up to
a power of two (torch's `host_memory_stats` says so), so three 1.42 GB buffers (355M's fp32 master and
AdamW moments at world size 1) would take 6 GiB of locked memory.

The ways measured, each in a fresh process of its own (its own empty host cache and allocator
settings), rounds alternating:
- `torch`: torch.empty(..., pin_memory=True), torch's default (cudaHostAlloc);
- `torch-register`: the same with the allocator's
  `pinned_use_cuda_host_register:True,pinned_num_register_threads:N` (malloc, pages faulted by N
  threads, then cudaHostRegister; N rounded down to a power of two, as torch asks);
- `register`: a block mapped exactly to size (as host_pool.py maps unpinned buffers), its pages
  written by N threads, then registered with cudaHostRegister (torch.cuda.cudart()).
Each reports its seconds, the growth of its process's RSS (the rounding shows there), whether torch
sees the buffers as pinned, a device-to-host copy's rate into them, and the longest gap between the
kernel launches of a thread beside it (a way that holds the driver or the GIL shows there).

Without CUDA only the part every way shares is measured: fresh memory's pages written by one thread
(`fault-1`) and by N (`fault-N`); the report says so.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

CUDA_WAYS = ("torch", "torch-register", "register")
CPU_WAYS = ("fault-1", "fault-N")
REGISTER_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
# torch reads PYTORCH_ALLOC_CONF where set (its newer name), else PYTORCH_CUDA_ALLOC_CONF: the option goes in both
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def register_threads(threads: int) -> int:
    """The register threads torch's allocator takes: a power of two (it refuses others), at most 128."""
    return min(128, 1 << (threads.bit_length() - 1))


def _written_by(buffers, threads: int) -> None:
    """Every page of `buffers` (uint8 tensors) written, split among `threads` threads (torch's
    fill_ lets the GIL go, so the page faults run side by side)."""
    parts = [b[i * len(b) // threads:(i + 1) * len(b) // threads] for b in buffers for i in range(threads)]
    workers = [threading.Thread(target=lambda ps: [p.fill_(0) for p in ps], args=(parts[i::threads],))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _mapped(nbytes: int):
    """A 1-D uint8 tensor over an anonymous mapping of exactly `nbytes` (no page touched yet)."""
    import torch

    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class _LaunchGaps:
    """A thread that launches tiny kernels back to back and keeps the longest gap between two."""

    def __init__(self) -> None:
        import torch

        self._x, self._stop, self.longest_s = torch.zeros(16, device="cuda"), threading.Event(), 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            self._x.add_(1.0)
            now = time.perf_counter()
            self.longest_s, last = max(self.longest_s, now - last), now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure_one(way: str, buffer_bytes: list[int], threads: int) -> dict:
    """One way of making pinned (CUDA) or fresh (CPU) buffers of `buffer_bytes`, in this process."""
    if way not in CUDA_WAYS + CPU_WAYS:
        raise ValueError(f"bench pinning: no way {way!r}: one of {', '.join(CUDA_WAYS + CPU_WAYS)}")
    import torch

    from elastic_zero.node_memory import rss_bytes

    torch.set_num_threads(1)
    on_cuda = way in CUDA_WAYS
    if on_cuda:
        torch.zeros(1, device="cuda")  # the context, before the clock
        with _LaunchGaps() as alone:
            time.sleep(0.3)
        sources = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in buffer_bytes]
        torch.cuda.synchronize()
    # the fill's code and the threads' stacks paged in before the count, so that it counts the buffers alone
    _written_by([_mapped(threads * mmap.PAGESIZE)], threads)
    rss, started = rss_bytes(os.getpid()), time.perf_counter()
    gaps = _LaunchGaps() if on_cuda else None
    with gaps if gaps is not None else contextlib.nullcontext():
        if way in ("torch", "torch-register"):
            buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in buffer_bytes]
        else:
            buffers = [_mapped(n) for n in buffer_bytes]
            _written_by(buffers, 1 if way == "fault-1" else threads)
            if way == "register":
                cudart = torch.cuda.cudart()
                for b in buffers:
                    code = cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)
                    if int(code) != 0:
                        raise RuntimeError(f"bench pinning: cudaHostRegister of {b.numel()} bytes failed ({code})")
    seconds = time.perf_counter() - started
    result = {"way": way, "seconds": round(seconds, 4), "rss_growth_bytes": rss_bytes(os.getpid()) - rss,
              "bytes": sum(buffer_bytes)}
    if on_cuda:
        result["pinned"] = all(b.is_pinned() for b in buffers)
        torch.cuda.synchronize()  # the launch thread's kernels, still queued, are not the copy's
        copy_started = time.perf_counter()
        for b, s in zip(buffers, sources):
            b.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        result["copy_gb_s"] = round(sum(buffer_bytes) / (time.perf_counter() - copy_started) / 1e9, 2)
        result["copied_right"] = all(bool(b[:: max(1, len(b) // 4096)].eq(1).all()) for b in buffers)
        result["launch_gap_s"], result["launch_gap_alone_s"] = round(gaps.longest_s, 4), round(alone.longest_s, 4)
        if way == "register":
            for b in buffers:
                torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    return result


def run_pinning_bench(mib: int = 1424, buffers: int = 3, threads: int | None = None, rounds: int = 2) -> dict:
    """Each way `rounds` times, alternating, each time in a new process: `mib` MiB in `buffers` buffers."""
    threads = min(8, os.cpu_count() or 1) if threads is None else threads
    for flag, value in (("--mib", mib), ("--buffers", buffers), ("--threads", threads), ("--rounds", rounds)):
        if value < 1:
            raise ValueError(f"bench pinning: {flag} must be at least 1, got {value}")
    from elastic_zero.node_memory import available_bytes

    free, total = available_bytes(), mib << 20
    if free is not None and 2 * total > free:  # a power-of-two rounding may double the buffers
        raise ValueError(f"bench pinning: --mib {mib} may take {2 * total / 2**30:.1f} GiB (rounded up to powers "
                         f"of two), more than this machine has free ({free / 2**30:.1f} GiB)")
    import torch

    on_cuda = torch.cuda.is_available()
    ways = CUDA_WAYS if on_cuda else CPU_WAYS
    sizes = [total // buffers + (1 if i < total % buffers else 0) for i in range(buffers)]
    runs: dict[str, list] = {way: [] for way in ways}
    for round_ in range(rounds):
        for way in ways:
            runs[way].append(_in_a_process(way, sizes, threads))
            # a line as each ends, so that a run cut short by a time limit keeps what it measured
            print(f"bench pinning: round {round_ + 1}, {way}: {json.dumps(runs[way][-1])}", file=sys.stderr)
    device = torch.cuda.get_device_name(0) if on_cuda else "cpu (no CUDA: only fresh pages written, by 1 and N threads)"
    return {"device": device, "bytes": total, "buffers": buffers, "threads": threads, "rounds": rounds,
            "ways": {way: _medians(rs) for way, rs in runs.items()}, "runs": runs}


def _in_a_process(way: str, sizes: list[int], threads: int) -> dict:
    env = dict(os.environ)
    if way == "torch-register":
        conf = REGISTER_CONF.format(threads=register_threads(threads))
        for name in ALLOC_CONF_VARS:
            env[name] = ",".join(c for c in (env.get(name), conf) if c)
    args = json.dumps({"way": way, "sizes": sizes, "threads": threads})
    proc = subprocess.run([sys.executable, "-m", "elastic_zero.bench.pinning", args], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:  # (a torch without an allocator option, say): reported, the other ways go on
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"way": way, "error": f"rc {proc.returncode}: {last}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _medians(runs: list[dict]) -> dict:
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        return {"error": failed[0]}
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = value if all(r[key] == value for r in runs) else [r[key] for r in runs]
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def format_pinning(report: dict) -> str:
    lines = [f"pinned host buffers: {report['bytes'] / 2**20:.0f} MiB in {report['buffers']} buffers, "
             f"{report['threads']} threads where a way uses them, medians of {report['rounds']} rounds; "
             f"{report['device']}",
             f"  {'way':16s}{'seconds':>9s}{'GB/s':>7s}{'RSS growth':>12s}"
             + (f"{'pinned':>8s}{'copy GB/s':>10s}{'launch gap s':>13s}{'alone':>7s}"
                if any("pinned" in m for m in report["ways"].values()) else "")]
    for way, m in report["ways"].items():
        if "error" in m:
            lines.append(f"  {way:16s}failed: {m['error']}")
            continue
        rate = m["bytes"] / m["seconds"] / 1e9 if m["seconds"] else float("inf")
        growth = f"{m['rss_growth_bytes'] / m['bytes']:.2f}x"
        cuda = (f"{str(m['pinned'] and m['copied_right']):>8s}{m['copy_gb_s']:10.1f}{m['launch_gap_s']:13.4f}"
                f"{m['launch_gap_alone_s']:7.4f}") if "pinned" in m else ""
        lines.append(f"  {way:16s}{m['seconds']:9.3f}{rate:7.1f}{growth:>12s}{cuda}")
    return "\n".join(lines)


if __name__ == "__main__":  # one way, in a process of its own (_in_a_process)
    request = json.loads(sys.argv[1])
    print(json.dumps(measure_one(request["way"], request["sizes"], request["threads"])))
