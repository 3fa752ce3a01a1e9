"""`elastic-zero bench checkpoint`: our sharded checkpoints against torch.distributed.checkpoint.

On N local ranks, the gpt-small training state (fp32 params and AdamW moments) is saved by
elastic_zero (ZeroEngine stage 2 shards) and by DCP (an FSDP2 model and optimizer state dict),
each synchronously and asynchronously; then M ranks load each checkpoint with resharding. In the
same run each rank measures its disk: a sequential write (with fsync) and read of as many bytes.
Page caches are dropped before every read when the machine allows it (root on Linux). Save
throughput is compared with the disk written by as many ranks at once, load throughput with the
disk read by as many ranks at once as load. Last, the same M ranks start a meta model at ZeRO-3
from that checkpoint and from its safetensors export (`init_from`): each rank reads its shard's part.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from elastic_zero.bench.baselines import ADAMW, default_group, fsdp2
from elastic_zero.bench.scratch import scratch_dir
from elastic_zero.testing.local_group import LocalRank, run_local_group
from elastic_zero.models import build_preset, lm_loss



def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:  # not root, or no /proc: the benchmark says it could not drop the page cache
        return False


def _one_step(model, step_fn) -> None:
    cfg = model.cfg
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    step_fn(lm_loss(model(idx[:, :-1]), idx[:, 1:]))


def _engine(preset, pg):
    from elastic_zero.zero import AdamW, ZeroEngine

    engine = ZeroEngine(build_preset(preset, seed=0), AdamW(**ADAMW), stage=2, process_group=pg)

    def step(loss):
        engine.backward(loss)
        engine.step()
        engine.zero_grad()

    _one_step(engine.module, step)
    return engine


def _fsdp(preset):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp2(build_preset(preset, seed=0))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    _one_step(model, step)
    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": opt_sd}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _disk(path: str, nbytes: int) -> tuple[float, float]:
    """Seconds to write (and fsync) then read `nbytes` sequentially."""
    data = os.urandom(1 << 20) * max(1, nbytes >> 20)

    def write():
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    w = _timed(write)
    _drop_caches()
    return w, _timed(lambda: _read_all(path))


def _read_all(path: str) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def _save_phase(ctx: LocalRank, preset: str, work: str, rounds: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from elastic_zero.checkpoint import commit, make_manifest, open_store
    from elastic_zero.checkpoint.store import step_dir, write_rank_file
    from elastic_zero.checkpoint.writer import AsyncCheckpointWriter

    with default_group(ctx, "bench-default/"):
        engine, dcp_state = _engine(preset, ctx.process_group), _fsdp(preset)
        fs, root = open_store(os.path.join(work, "ours"))
        out = {k: [] for k in ("ours_sync", "ours_stall", "ours_stall_snapshot_ready", "dcp_sync", "dcp_stall",
                               "disk_write", "disk_read")}
        for r in range(rounds):
            dist.barrier()

            def ours_sync():
                state = engine.shard_state()
                state.scalars["step"] = 100 + r
                entry = write_rank_file(fs, step_dir(root, 100 + r), state)
                entries = [None] * ctx.world_size
                dist.all_gather_object(entries, entry)
                if ctx.rank == 0:
                    commit(fs, root, make_manifest(state, entries, 2), keep=2)
                dist.barrier()

            out["ours_sync"].append(_timed(ours_sync))
            writer = AsyncCheckpointWriter(os.path.join(work, "ours"), ctx.store, keep=2, stage=2)

            def ours_async():
                state = engine.shard_state()  # the snapshot to host memory is part of the stall
                state.scalars["step"] = 200 + r
                writer.save(state, f"bench-{r}", {})

            out["ours_stall"].append(_timed(ours_async))
            writer.wait()
            # in the runtime the replication snapshot of the same step is reused: no copy to make
            ready = engine.shard_state()
            ready.scalars["step"] = 300 + r
            dist.barrier()
            out["ours_stall_snapshot_ready"].append(_timed(lambda: writer.save(ready, f"bench-ready-{r}", {})))
            writer.wait()
            errors = writer.take_errors()
            assert not errors, errors
            dist.barrier()
            out["dcp_sync"].append(_timed(lambda: dcp.save(dcp_state, checkpoint_id=os.path.join(work, f"dcp-{r}"))))
            dist.barrier()
            holder = {}
            out["dcp_stall"].append(_timed(lambda: holder.setdefault(
                "f", dcp.async_save(dcp_state, checkpoint_id=os.path.join(work, f"dcp-async-{r}")))))
            holder["f"].result()
            dist.barrier()
            nbytes = sum(v.nbytes for v in engine.shard_state().vectors.values())
            w, rd = _disk(os.path.join(work, f"disk-{ctx.rank}.bin"), nbytes)
            out["disk_write"].append(w)
            out["disk_read"].append(rd)
        out["bytes"] = nbytes
        return out


def _load_phase(ctx: LocalRank, preset: str, work: str, rounds: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from elastic_zero.checkpoint import load_shard, open_store, resolve
    from elastic_zero.zero import AdamW, ZeroEngine

    with default_group(ctx, "bench-load/"):
        engine = ZeroEngine(build_preset(preset, seed=1), AdamW(**ADAMW), stage=2, process_group=ctx.process_group)
        dcp_state = _fsdp(preset)
        fs, root = open_store(os.path.join(work, "ours"))
        out = {"ours_load": [], "dcp_load": [], "disk_read_same_readers": [], "dropped_caches": True}
        my_bytes = sum(v.nbytes for v in engine.shard_state().vectors.values())
        disk_file = os.path.join(work, f"disk-load-{ctx.rank}.bin")
        with open(disk_file, "wb") as fh:
            fh.write(os.urandom(1 << 20) * max(1, my_bytes >> 20))
            os.fsync(fh.fileno())
        for r in range(rounds):
            dist.barrier()
            if ctx.rank == 0:
                out["dropped_caches"] &= _drop_caches()
            dist.barrier()
            # read and check only, as dcp.load fills a state dict without applying it
            out["ours_load"].append(_timed(lambda: load_shard(fs, resolve(fs, root), engine.layout, ctx.world_size,
                                                              ctx.rank, engine.vector_names())))
            dist.barrier()
            if ctx.rank == 0:
                _drop_caches()
            dist.barrier()
            out["dcp_load"].append(_timed(lambda: dcp.load(dcp_state, checkpoint_id=os.path.join(work, "dcp-0"))))
            dist.barrier()
            if ctx.rank == 0:
                _drop_caches()
            dist.barrier()  # the disk read by as many concurrent readers, of as many bytes each
            out["disk_read_same_readers"].append(_timed(lambda: _read_all(disk_file)))
        out["bytes"] = my_bytes
        out.update(_start_from(ctx, preset, os.path.join(work, "ours")))
        return out


def _start_from(ctx: LocalRank, preset: str, root: str) -> dict:
    """The weights to start from (`init_from`), read by a meta model's ZeRO-3 engine on every rank:
    our checkpoint and its safetensors export, each rank's seconds and bytes read."""
    from elastic_zero.checkpoint import load_initial_weights
    from elastic_zero.checkpoint.export import export
    from elastic_zero.zero import AdamW, ZeroEngine
    from elastic_zero.zero.meta import meta_init

    exported = os.path.join(os.path.dirname(root), "start-from.safetensors")
    if ctx.rank == 0:
        export(root, exported, "safetensors")
    out = {}
    for kind, source in (("checkpoint", root), ("safetensors", exported)):
        dist.barrier()
        if ctx.rank == 0:
            _drop_caches()
        dist.barrier()
        started = time.perf_counter()
        weights = load_initial_weights(source)
        with meta_init():
            model = build_preset(preset, seed=2)
        ZeroEngine(model, AdamW(**ADAMW), stage=3, process_group=ctx.process_group, init_values=weights)
        out[f"start_{kind}_s"] = time.perf_counter() - started
        out[f"start_{kind}_read"] = weights.bytes_read
    out["model_bytes"] = sum(p.numel() * 4 for p in model.parameters())  # fp32, as both sources hold it
    return out


def run_checkpoint_bench(preset: str = "gpt-small", save_workers: int = 2, load_workers: int = 3,
                         rounds: int = 3) -> dict:
    with scratch_dir("elastic-zero-ckpt-bench-") as work:  # the checkpoints: gigabytes at a real size
        saves = run_local_group(_save_phase, save_workers, (preset, work, rounds), timeout_s=1800)
        loads = run_local_group(_load_phase, load_workers, (preset, work, rounds), timeout_s=1800)
    med = statistics.median

    def worst(results, key):  # the slowest rank sets the pace of a collective save or load
        return med([max(r[key][i] for r in results) for i in range(rounds)])

    nbytes = saves[0]["bytes"]
    total = sum(r["bytes"] for r in saves)
    per_rank_load = total / load_workers
    report = {
        "preset": preset, "save_workers": save_workers, "load_workers": load_workers, "rounds": rounds,
        "bytes_per_rank": nbytes,
        "ours_sync_save_s": worst(saves, "ours_sync"), "ours_async_stall_s": worst(saves, "ours_stall"),
        "ours_async_stall_snapshot_ready_s": worst(saves, "ours_stall_snapshot_ready"),
        "dcp_sync_save_s": worst(saves, "dcp_sync"), "dcp_async_stall_s": worst(saves, "dcp_stall"),
        "ours_load_s": worst(loads, "ours_load"), "dcp_load_s": worst(loads, "dcp_load"),
        "disk_write_mb_s": nbytes / worst(saves, "disk_write") / 1e6,
        "disk_read_mb_s": nbytes / worst(saves, "disk_read") / 1e6,
        "caches_dropped": all(r["dropped_caches"] for r in loads),
    }
    for kind in ("checkpoint", "safetensors"):  # the slowest rank, and the most any rank read of the model
        report[f"start_{kind}_s"] = max(r[f"start_{kind}_s"] for r in loads)
        report[f"start_{kind}_read_of_model"] = max(r[f"start_{kind}_read"] for r in loads) / loads[0]["model_bytes"]
    report["ours_stall_vs_sync"] = report["ours_async_stall_s"] / report["ours_sync_save_s"]
    report["ours_stall_snapshot_ready_vs_sync"] = report["ours_async_stall_snapshot_ready_s"] / report["ours_sync_save_s"]
    report["dcp_stall_vs_sync"] = report["dcp_async_stall_s"] / report["dcp_sync_save_s"]
    report["ours_save_mb_s"] = nbytes / report["ours_sync_save_s"] / 1e6
    report["ours_load_mb_s"] = per_rank_load / report["ours_load_s"] / 1e6
    report["disk_read_same_readers_mb_s"] = loads[0]["bytes"] / worst(loads, "disk_read_same_readers") / 1e6
    report["save_vs_disk"] = report["ours_save_mb_s"] / report["disk_write_mb_s"]
    report["load_vs_disk"] = report["ours_load_mb_s"] / report["disk_read_same_readers_mb_s"]
    report["load_vs_dcp"] = report["ours_load_s"] / report["dcp_load_s"]
    return report


def format_checkpoint(r: dict) -> str:
    return "\n".join([
        f"bench checkpoint: {r['preset']} params + AdamW moments, saved by {r['save_workers']} ranks "
        f"({r['bytes_per_rank'] / 2**20:.1f} MiB each), loaded by {r['load_workers']}; medians of {r['rounds']}",
        f"  disk          write {r['disk_write_mb_s']:8.1f} MB/s   read {r['disk_read_mb_s']:8.1f} MB/s "
        f"(per rank, {r['save_workers']} at once); read {r['disk_read_same_readers_mb_s']:.1f} MB/s per rank with "
        f"{r['load_workers']} at once (caches dropped: {r['caches_dropped']})",
        f"  elastic_zero  sync save {r['ours_sync_save_s']:.3f} s ({r['ours_save_mb_s']:.1f} MB/s, "
        f"{r['save_vs_disk']:.2f}x disk)  async stall {r['ours_async_stall_s']:.3f} s "
        f"({r['ours_stall_vs_sync']:.3f} of sync; {r['ours_stall_snapshot_ready_vs_sync']:.3f} when the replication "
        f"snapshot is reused)  load {r['ours_load_s']:.3f} s ({r['load_vs_disk']:.2f}x disk)",
        f"  DCP           sync save {r['dcp_sync_save_s']:.3f} s  async stall {r['dcp_async_stall_s']:.3f} s "
        f"({r['dcp_stall_vs_sync']:.3f} of sync)  load {r['dcp_load_s']:.3f} s",
        f"  load {r['save_workers']} -> {r['load_workers']} ranks: elastic_zero / DCP = {r['load_vs_dcp']:.3f}",
        f"  start a meta model at ZeRO-3 from it (init_from) on {r['load_workers']} ranks: checkpoint "
        f"{r['start_checkpoint_s']:.3f} s, each rank read {r['start_checkpoint_read_of_model']:.2f} of the model; "
        f"its safetensors export {r['start_safetensors_s']:.3f} s, {r['start_safetensors_read_of_model']:.2f}",
    ])
