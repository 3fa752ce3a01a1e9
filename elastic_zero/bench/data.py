"""`elastic-zero bench data`: a worker's streaming data path against a plain pyarrow.dataset scan.

A token dataset of about --size-gb GB of int32 tokens is generated once under --dir (token_dataset.py; Arrow IPC
files, or Parquet with pyarrow's default encoding): rows of seq_len + 1 random token ids, in
record batches (row groups) of --batch-rows rows. The first token of each row is the row's index
rather than a token, so each reader proves from the tensors it made that it read every sample
exactly once.

Two pools of --workers spawned processes (one torch thread each) then read it, in the same run:

- ours: rank r of N opens the job's data source (data.source.open_source with the default token
  collate) and, as a worker does, reads its coming shares ahead (read_ahead_for_step) and asks
  `source.batch(rank_positions(step, global_batch, N, r))` for the steps of
  one epoch (rows // global_batch steps; the last rows % global_batch samples stay unread): the
  real worker path, block-shuffled order and collate to tensors included;
- baseline: worker r scans every N-th file with pyarrow.dataset.dataset(files, format=...)
  .to_batches(columns=["tokens"]) at pyarrow's defaults (its threads, readahead and batch size)
  and makes of each record batch what the collate makes: input_ids and targets (int64, rows x
  seq_len) and sample_weight (float32). It relies on every row having seq_len + 1 tokens, which
  the collate checks and pads for.

Before the rounds the page cache is warmed by reading every file once, so neither side pays for
the disk, and the sides alternate which reads first in each round. A side's samples/s is all its
workers' samples over the slowest worker's time (workers start together at a barrier); the
report gives medians over --rounds.

Memory: each worker samples /proc/self/status from just after it opened its source (the "start")
to the end of the last round. Memory-mapped IPC files show in VmRSS as the page-cache pages a
worker touched (RssFile): the kernel shares and reclaims them, the worker does not own them. The
memory goal is therefore judged on RssAnon: the peak growth over the start, per worker. VmRSS
growth is reported beside it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import time
import traceback

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import torch

from elastic_zero.bench.token_dataset import COLUMN, FILES, token_dataset
from elastic_zero.data.source import read_ahead_for_step
from elastic_zero.plan.batches import rank_positions

MEMORY_GOAL_MB = 200.0
RATIO_GOAL = 0.9
_MEMORY_EVERY = 512  # samples read between two memory samples (or one record batch, when larger)
_TIMEOUT_S = 3600.0


def _warm_page_cache(path: str) -> None:
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as fh:
            while fh.read(1 << 24):
                pass


# ---- the readers, one per worker process


def _memory_kb() -> dict[str, int]:
    """This process's resident memory: anonymous (owned) and total (VmRSS, file pages included)."""
    fields = {"RssAnon:": "anon", "VmRSS:": "total"}
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(maxsplit=1)[0]
            if key in fields:
                out[fields[key]] = int(line.split()[1])
    return out


class _Memory:
    """Resident memory from its creation (the start) on: the latest and the peak of what was sampled."""

    def __init__(self) -> None:
        self.start = _memory_kb()
        self.peak, self.now = dict(self.start), dict(self.start)

    def sample(self) -> None:
        self.now = _memory_kb()
        self.peak = {k: max(self.peak[k], v) for k, v in self.now.items()}

    def report(self) -> dict[str, dict[str, float]]:
        return {"rss_start_mb": {k: v / 1024 for k, v in self.start.items()},
                "rss_growth_mb": {"anon": (self.now["anon"] - self.start["anon"]) / 1024,
                                  "anon_peak": (self.peak["anon"] - self.start["anon"]) / 1024,
                                  "total": (self.now["total"] - self.start["total"]) / 1024,
                                  "total_peak": (self.peak["total"] - self.start["total"]) / 1024}}


def _read(batches, sample_ids: np.ndarray, memory: _Memory) -> int:
    """Consume `batches`, writing each sample's first token (its index) into sample_ids; memory is
    sampled every _MEMORY_EVERY samples. Returns the number of samples."""
    filled, next_sample = 0, 0
    for batch in batches:
        n = batch["input_ids"].shape[0]
        sample_ids[filled : filled + n] = batch["input_ids"][:, 0].numpy()
        filled += n
        if filled >= next_sample:
            memory.sample()
            next_sample = filled + _MEMORY_EVERY
    return filled


class _OursReader:
    """Rank `rank` of `workers`: the steps of one epoch through the job's data source."""

    def __init__(self, path: str, seq_len: int, global_batch: int, workers: int, rank: int, steps: int) -> None:
        from elastic_zero.data.source import open_source
        from elastic_zero.job.spec import DataSpec

        self.source = open_source(DataSpec(source=path, column=COLUMN), seed=0, vocab_size=None, seq_len=seq_len,
                                  collate=None)
        self.shares = [rank_positions(step, global_batch, workers, rank) for step in range(steps)]
        self.sample_ids = np.full(sum(len(s) for s in self.shares), -1, dtype=np.int64)  # touched before the start

    def read_epoch(self, memory: _Memory) -> int:
        return _read(self._batches(), self.sample_ids, memory)

    def _batches(self):
        """As a worker reads: its coming shares read ahead, then one batch per step."""
        for step, positions in enumerate(self.shares):
            read_ahead_for_step(self.source, step, len(self.shares), self.shares.__getitem__)
            yield self.source.batch(positions)

    @property
    def blocks_read(self) -> int:  # blocks decoded: misses of ArrowRows' block cache
        return self.source.rows.blocks_read


class _ScanReader:
    """Worker `rank` of `workers`: a plain pyarrow.dataset scan of every workers-th file."""

    def __init__(self, path: str, fmt: str, seq_len: int, workers: int, rank: int) -> None:
        files = sorted(ds.dataset(path, format=fmt).files)[rank::workers]
        self.dataset, self.seq_len, self.blocks_read = ds.dataset(files, format=fmt), seq_len, 0
        self.sample_ids = np.full(self.dataset.count_rows(), -1, dtype=np.int64)

    def read_epoch(self, memory: _Memory) -> int:
        return _read((self._tensors(b) for b in self.dataset.to_batches(columns=[COLUMN])), self.sample_ids, memory)

    def _tensors(self, record_batch: pa.RecordBatch) -> dict[str, torch.Tensor]:
        # the conversion of token_collate's fixed-length path, so the sides differ only in how they read
        self.blocks_read += 1
        n = record_batch.num_rows
        rows_2d = record_batch.column(0).flatten().to_numpy().reshape(n, self.seq_len + 1)
        return {"input_ids": torch.from_numpy(rows_2d[:, :-1].astype(np.int64)),
                "targets": torch.from_numpy(rows_2d[:, 1:].astype(np.int64)),
                "sample_weight": torch.full((n,), float(self.seq_len))}


def _worker(side: str, rank: int, args: dict, commands, results, barrier) -> None:
    """One reader process: open, report ready, then read one epoch per command until None."""
    torch.set_num_threads(1)
    try:
        if side == "ours":
            reader = _OursReader(args["path"], args["seq_len"], args["global_batch"], args["workers"], rank,
                                 args["steps"])
        else:
            reader = _ScanReader(args["path"], args["format"], args["seq_len"], args["workers"], rank)
        memory = _Memory()
        results.put((side, rank, "ready", None))
        while commands.get() is not None:
            blocks = reader.blocks_read
            barrier.wait()  # the side's workers start together: its time is the slowest one's
            start = time.perf_counter()
            samples = reader.read_epoch(memory)
            elapsed = time.perf_counter() - start
            memory.sample()
            results.put((side, rank, "round", {"elapsed_s": elapsed, "samples": samples,
                                               "sample_ids": reader.sample_ids.copy(),
                                               "blocks_read": reader.blocks_read - blocks}))
        results.put((side, rank, "done", memory.report()))
    except BaseException:  # sent to the parent, which raises it
        results.put((side, rank, "error", traceback.format_exc()))


class _Pool:
    """`workers` reader processes of one side, kept for all rounds."""

    def __init__(self, ctx, side: str, args: dict, results) -> None:
        self.side, self.results, workers = side, results, args["workers"]
        # kept for the pool's life: a spawned child unpickles it later, and it must still exist then
        self.barrier = ctx.Barrier(workers)
        self.commands = [ctx.Queue() for _ in range(workers)]
        self.procs = [ctx.Process(target=_worker, args=(side, r, args, self.commands[r], results, self.barrier),
                                  daemon=True) for r in range(workers)]
        for p in self.procs:
            p.start()

    def send(self, command: str | None) -> None:
        """"read": every worker reads one epoch; None: they report their memory growth and end."""
        for q in self.commands:
            q.put(command)

    def round(self) -> list[dict]:
        self.send("read")
        return _collect(self.results, {self.side: self}, "round")[self.side]

    def close(self) -> None:
        self.send(None)  # after a failure some may still wait for a command
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _collect(results, pools: dict[str, _Pool], kind: str) -> dict[str, list]:
    """One `kind` message from every worker of `pools`, in rank order per side."""
    got = {side: [None] * len(pool.procs) for side, pool in pools.items()}
    missing = sum(len(pool.procs) for pool in pools.values())
    deadline = time.monotonic() + _TIMEOUT_S
    while missing:
        try:
            side, rank, what, payload = results.get(timeout=0.5)
        except queue_mod.Empty:
            for side, pool in pools.items():
                for rank, p in enumerate(pool.procs):
                    if p.exitcode is not None and got[side][rank] is None:
                        raise RuntimeError(f"bench data: {side} worker {rank} exited with code {p.exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench data: no {kind} from the workers in {_TIMEOUT_S:.0f} s") from None
            continue
        if what == "error":
            raise RuntimeError(f"bench data: {side} worker {rank} failed:\n{payload}")
        assert what == kind, (what, kind)
        got[side][rank] = payload
        missing -= 1
    return got


# ---- the benchmark


def _read_once(rounds: list[list[dict]], expected_counts: np.ndarray) -> bool:
    """Every round's workers together read each sample as often as expected_counts says."""
    for workers in rounds:
        ids = np.concatenate([w["sample_ids"] for w in workers])
        if ids.min(initial=0) < 0 or not np.array_equal(np.bincount(ids, minlength=expected_counts.size),
                                                        expected_counts):
            return False
    return True


def run_data_bench(size_gb: float = 2.0, directory: str = "runs/bench-data", fmt: str = "ipc", seq_len: int = 1024,
                   workers: int = 2, global_batch: int = 64, rounds: int = 3, batch_rows: int = 2048) -> dict:
    from elastic_zero.data.arrow_rows import ArrowRows
    from elastic_zero.data.order import BlockShuffledOrder

    if workers < 1 or rounds < 1 or global_batch < workers:
        raise ValueError(f"need workers >= 1, rounds >= 1 and a global batch >= workers (got {workers} workers, "
                         f"{rounds} rounds, global batch {global_batch})")
    data = token_dataset(directory, size_gb, fmt, seq_len, batch_rows)
    rows, path = data["rows"], data["path"]
    steps = rows // global_batch
    if steps < 1:
        raise ValueError(f"the dataset has {rows} rows, fewer than a global batch of {global_batch}")
    block_sizes = ArrowRows(path, [COLUMN]).block_sizes
    ours_counts = np.bincount(BlockShuffledOrder(block_sizes, seed=0).samples(range(steps * global_batch)),
                              minlength=rows)
    _warm_page_cache(path)

    args = {"path": path, "format": fmt, "seq_len": seq_len, "global_batch": global_batch, "workers": workers,
            "steps": steps}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    pools = {side: _Pool(ctx, side, args, results) for side in ("ours", "baseline")}
    try:
        _collect(results, pools, "ready")
        timed = {"ours": [], "baseline": []}
        for r in range(rounds):
            order = ("ours", "baseline") if r % 2 == 0 else ("baseline", "ours")
            for side in order:
                timed[side].append(pools[side].round())
        for pool in pools.values():
            pool.send(None)
        memory = _collect(results, pools, "done")
    finally:
        for pool in pools.values():
            pool.close()

    med = statistics.median

    def per_worker(side):
        return [{"rank": rank, "samples_per_s": med(ws[rank]["samples"] / ws[rank]["elapsed_s"] for ws in timed[side]),
                 "blocks_read_per_round": med(ws[rank]["blocks_read"] for ws in timed[side]),
                 **memory[side][rank]} for rank in range(workers)]

    per_round = [{"first": "ours" if r % 2 == 0 else "baseline", "ours": _side_rate(timed["ours"][r]),
                  "baseline": _side_rate(timed["baseline"][r])} for r in range(rounds)]
    ours, baseline = med(x["ours"] for x in per_round), med(x["baseline"] for x in per_round)
    worst_anon = max(m["rss_growth_mb"]["anon_peak"] for m in memory["ours"])
    return {
        "dataset": path, "format": fmt, "dataset_gb": rows * (seq_len + 1) * 4 / 1e9,
        "disk_gb": data["disk_bytes"] / 1e9, "rows": rows, "seq_len": seq_len, "files": FILES,
        "blocks": len(block_sizes), "workers": workers, "global_batch": global_batch, "steps_per_round": steps,
        "samples_per_round": steps * global_batch, "samples_unread_per_round": rows - steps * global_batch,
        "rounds": rounds,
        "warm_up": "page cache warmed by reading every file once; the sides alternate which reads first each round",
        "samples_per_s": ours, "baseline_samples_per_s": baseline, "ratio": ours / baseline,
        "round_samples_per_s": per_round,
        "ours_workers": per_worker("ours"), "baseline_workers": per_worker("baseline"),
        "ours_each_sample_once": _read_once(timed["ours"], ours_counts),
        "baseline_each_sample_once": _read_once(timed["baseline"], np.ones(rows, dtype=np.int64)),
        "memory_goal_judged_on": "peak RssAnon growth per worker over its resident memory just after opening the "
                                 "source; VmRSS also counts the pages of the memory-mapped files, page cache",
        "worst_rss_anon_peak_growth_mb": worst_anon,
        "goals_met": {"memory": worst_anon < MEMORY_GOAL_MB, "speed": ours / baseline >= RATIO_GOAL},
    }


def _side_rate(workers: list[dict]) -> float:
    """A side's samples/s in one round: all its workers' samples over the slowest worker's time."""
    return sum(w["samples"] for w in workers) / max(w["elapsed_s"] for w in workers)


def format_data_report(r: dict) -> str:
    def rows(name, rate, workers):
        out = []
        for w in workers:
            start, growth = w["rss_start_mb"], w["rss_growth_mb"]
            out.append(f"  {name if w['rank'] == 0 else '':<16}{f'{rate:.0f}' if w['rank'] == 0 else '':>10}"
                       f"{w['rank']:>8}{w['samples_per_s']:>11.0f}{w['blocks_read_per_round']:>8.0f}"
                       f"{start['anon']:>10.1f}{growth['anon']:>10.1f}{growth['anon_peak']:>8.1f}"
                       f"{start['total']:>10.1f}{growth['total']:>10.1f}{growth['total_peak']:>8.1f}")
        return out

    goals = r["goals_met"]
    return "\n".join([
        f"bench data: {r['dataset_gb']:.2f} GB of int32 tokens ({r['rows']} rows of {r['seq_len'] + 1} in {r['files']} "
        f"{r['format']} files, {r['blocks']} blocks; {r['disk_gb']:.2f} GB on disk) at {r['dataset']}",
        f"  {r['workers']} workers, global batch {r['global_batch']}: {r['steps_per_round']} steps a round "
        f"({r['samples_per_round']} samples, {r['samples_unread_per_round']} left unread); medians of {r['rounds']} "
        f"rounds; {r['warm_up']}",
        f"  {'':<16}{'':>10}{'':>8}{'':>11}{'':>8}{'RssAnon MB':>28}{'VmRSS MB':>28}",
        f"  {'reader':<16}{'samples/s':>10}{'worker':>8}{'samples/s':>11}{'blocks':>8}"
        f"{'start':>10}{'growth':>10}{'peak':>8}{'start':>10}{'growth':>10}{'peak':>8}",
        *rows("elastic_zero", r["samples_per_s"], r["ours_workers"]),
        *rows("pyarrow.dataset", r["baseline_samples_per_s"], r["baseline_workers"]),
        "  rounds, samples/s ours/baseline: " + ", ".join(
            f"{x['ours']:.0f}/{x['baseline']:.0f} ({x['first']} first)" for x in r["round_samples_per_s"]),
        f"  ratio ours/baseline {r['ratio']:.3f} (goal >= {RATIO_GOAL}: {'met' if goals['speed'] else 'NOT met'})",
        f"  worst peak RssAnon growth of our workers {r['worst_rss_anon_peak_growth_mb']:.1f} MB (goal < "
        f"{MEMORY_GOAL_MB:.0f} MB: {'met' if goals['memory'] else 'NOT met'}), judged on RssAnon: VmRSS also counts "
        f"the pages of the memory-mapped files, page cache",
        f"  each sample read exactly once: ours {r['ours_each_sample_once']}, "
        f"baseline {r['baseline_each_sample_once']}",
    ])
