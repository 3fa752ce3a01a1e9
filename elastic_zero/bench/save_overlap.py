"""`elastic-zero bench save-overlap`: what a checkpoint's background write costs the training thread
beside it, on this host.

A save is written by a thread of the worker's process (checkpoint/writer.py) while its training
thread goes on. On a GPU that thread is bound by the GIL (it queues kernels and reads back little),
so whatever the writing thread does while it holds the GIL comes out of the step. Side by side in one
run, rounds alternating, this measures a GIL-bound stand-in for the training thread (small torch ops
in a loop): its rate alone; beside a real save (AsyncCheckpointWriter, a world-size-1 shard of
`numel` fp32 master elements and two AdamW moments, into a local directory); beside the same bytes
written, CRC'd and synced by another process, which shares no GIL with it (the floor this host's
cores and disk set for any thread beside a write); and beside the same bytes copied block by block
into bytes objects, as the writer did before 2026-11-29 (such a copy holds the GIL for its whole
length). The stand-in's rate beside each, against alone (the mean of just before and just after),
is what a step bound by the GIL would keep; a write's CPU is its thread's or its process's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time

ALONE_S = 1.0  # how long the stand-in runs alone, before and after each write
PROCESS_FILE = "written-by-a-process.bin"


def _stand_in_rate(until) -> float:
    """Ops per second of a GIL-bound loop (a tiny in-place add each) while `until()` holds."""
    import torch

    x, n, started = torch.zeros(64), 0, time.perf_counter()
    while until():
        x.add_(1.0)
        n += 1
    return n / max(time.perf_counter() - started, 1e-9)


def _snapshot(numel: int):
    """A world-size-1 AdamW shard of `numel` elements (ten units, as a model's layers)."""
    import torch

    from elastic_zero.plan.layout import ParamSpec, build_layout
    from elastic_zero.plan.partition import partition_layout
    from elastic_zero.zero.shard import ShardState

    units = min(10, numel)
    specs = [ParamSpec(f"w{i}", (numel // units + (1 if i < numel % units else 0),), "float32", f"u{i}")
             for i in range(units)]
    layout = build_layout(specs)
    vectors = {name: torch.randn(numel) for name in ("params", "exp_avg", "exp_avg_sq")}
    return ShardState(layout, partition_layout(layout, 1), 0, vectors, {"step": 1})


def _copies_under_the_gil(snapshot) -> None:
    """The writer's copies before 2026-11-29: each 4 MB block into a bytes object (its CRC and its
    write, which release the GIL, left out: this is the part that held it)."""
    from elastic_zero.checkpoint.store import BIT_VIEWS, BLOCK_NUMEL

    for values in snapshot.vectors.values():
        for start in range(0, values.numel(), BLOCK_NUMEL):
            values[start : start + BLOCK_NUMEL].view(BIT_VIEWS[values.element_size()]).numpy().tobytes()


def _alone() -> float:
    """The stand-in's rate with nothing beside it, over ALONE_S."""
    end = time.perf_counter() + ALONE_S
    return _stand_in_rate(lambda: time.perf_counter() < end)


_WRITER_PROCESS = """
import os, sys, zlib
import numpy as np
import pyarrow.fs as pafs
path, nbytes, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)).cast("B")
sys.stdout.write("+")
sys.stdout.flush()
sys.stdin.readline()
with pafs.LocalFileSystem().open_output_stream(path) as out:
    for start in range(0, nbytes, block):
        out.write(data[start : start + block])
        zlib.crc32(data[start : start + block])
fd = os.open(path, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""


def _write_in_a_process(path: str, nbytes: int):
    """The same bytes written, CRC'd and synced in 4 MB blocks by another process, which shares no GIL
    with the stand-in: what this host's cores and disk cost a thread beside any write. Returns the
    work to run: it starts the (ready) process's write and waits for its end."""
    import subprocess
    import sys

    from elastic_zero.checkpoint.store import BLOCK_NUMEL

    proc = subprocess.Popen([sys.executable, "-c", _WRITER_PROCESS, path, str(nbytes), str(BLOCK_NUMEL * 4)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if proc.stdout.read(1) != b"+":
        raise RuntimeError(f"bench save-overlap: the writing process ended before it was ready (rc {proc.wait()})")

    def work():
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        if proc.wait() != 0:
            raise RuntimeError(f"bench save-overlap: the writing process failed (rc {proc.returncode})")

    return work


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _beside(work) -> dict:
    """Run `work()` on a thread: the stand-in's rate beside it against its rate alone (the mean of
    just before and just after), and the work's wall and CPU (its thread's, or its process's)."""
    done, failed = threading.Event(), []

    def run():
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised again on the bench's thread, below
            failed.append(exc)
        finally:
            done.set()

    before = _alone()
    cpu, own, children = time.process_time(), time.thread_time(), _children_cpu()
    started = time.perf_counter()
    thread = threading.Thread(target=run, name="bench-save")
    thread.start()
    rate = _stand_in_rate(lambda: not done.is_set())
    wall = time.perf_counter() - started
    thread.join()
    if failed:
        raise failed[0]
    work_cpu = (time.process_time() - cpu) - (time.thread_time() - own) + (_children_cpu() - children)
    return {"kept": rate / ((before + _alone()) / 2), "wall_s": wall, "cpu_s": work_cpu}


def _clear(root: str) -> None:
    """The last round's files gone and its pages written back, not while this round measures."""
    shutil.rmtree(os.path.join(root, "ckpt"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(root, PROCESS_FILE))
    os.sync()


def run_save_overlap_bench(numel: int = 100_000_000, rounds: int = 4, directory: str | None = None) -> dict:
    if numel < 1:
        raise ValueError(f"bench save-overlap: --numel must be at least 1, got {numel}")
    if rounds < 1:
        raise ValueError(f"bench save-overlap: --rounds must be at least 1, got {rounds}")
    from elastic_zero.node_memory import available_bytes

    free, needed = available_bytes(), 2 * 3 * 4 * numel  # the shard, and the writing process's bytes
    if free is not None and needed > free:
        raise ValueError(f"bench save-overlap: --numel {numel:,} needs {needed / 2**30:.1f} GiB (the shard and another "
                         f"process's copy of it), more than this machine has free ({free / 2**30:.1f} GiB)")
    if directory is not None and not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
        raise ValueError(f"bench save-overlap: --dir {directory!r} is not a directory this process can write in")
    import torch
    import torch.distributed as dist

    from elastic_zero.checkpoint.writer import AsyncCheckpointWriter

    torch.set_num_threads(1)  # as in a worker
    snapshot = _snapshot(numel)
    root = tempfile.mkdtemp(prefix="ez-save-overlap-", dir=directory)
    store = dist.HashStore()
    rows: dict[str, list[dict]] = {"save": [], "process": [], "copies": []}
    try:
        for r in range(rounds):
            for way in ("save", "process", "copies") if r % 2 == 0 else ("copies", "process", "save"):
                _clear(root)
                if way == "save":
                    writer = AsyncCheckpointWriter(f"file://{root}/ckpt", store, keep=1, stage=2)

                    def work(writer=writer, tag=f"r{r}"):
                        writer.save(snapshot, tag, {})
                        writer.wait()
                        if errors := writer.take_errors():
                            raise RuntimeError(f"bench save-overlap: the save failed: {errors[0]}")
                elif way == "process":
                    work = _write_in_a_process(os.path.join(root, PROCESS_FILE), snapshot.nbytes())
                else:
                    def work():
                        _copies_under_the_gil(snapshot)
                rows[way].append(_beside(work))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def summary(way: str) -> dict:
        runs = rows[way]
        kept, wall = statistics.median(r["kept"] for r in runs), statistics.median(r["wall_s"] for r in runs)
        return {"kept_median": round(kept, 3), "kept": [round(r["kept"], 3) for r in runs],
                "stood_still_s": round(wall * max(0.0, 1.0 - kept), 3),  # what a GIL-bound step loop loses
                "wall_s_median": round(wall, 3),
                "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3)}

    nbytes = snapshot.nbytes()
    save = summary("save")
    return {"numel": numel, "bytes": nbytes, "rounds": rounds, "cores": os.cpu_count(), "save": save,
            "write_in_a_process": summary("process"), "copies_under_the_gil": summary("copies"),
            "save_gb_per_s": round(nbytes / 1e9 / save["wall_s_median"], 2) if save["wall_s_median"] else None}


def format_save_overlap(report: dict) -> str:
    save, process, copies = report["save"], report["write_in_a_process"], report["copies_under_the_gil"]
    return "\n".join([
        f"a save of {report['bytes'] / 2**30:.2f} GiB (world size 1, {report['numel']:,} fp32 elements and two "
        f"moments), {report['rounds']} rounds alternating, {report['cores']} cores:",
        f"  beside the save, the training thread's stand-in keeps {save['kept_median']:.2f}x its rate alone "
        f"({', '.join(f'{k:.2f}' for k in save['kept'])}): it stands still {save['stood_still_s']:.3f} s; "
        f"the save takes {save['wall_s_median']:.2f} s ({report['save_gb_per_s']} GB/s), "
        f"{save['cpu_s_median']:.2f} s of CPU",
        f"  beside the same bytes written by another process (no GIL shared: this host's floor): "
        f"{process['kept_median']:.2f}x ({', '.join(f'{k:.2f}' for k in process['kept'])}) for "
        f"{process['wall_s_median']:.2f} s",
        f"  beside the same bytes copied under the GIL (the writer before 2026-11-29): {copies['kept_median']:.2f}x "
        f"({', '.join(f'{k:.2f}' for k in copies['kept'])}): it stands still {copies['stood_still_s']:.3f} s, "
        f"the copies' {copies['wall_s_median']:.2f} s",
    ])
