"""`elastic-zero bench step`: step time of ZeRO stage 1/2/3 against torch DDP (and FSDP2) in one run.

All variants train the same preset with the same data on the same local gloo ranks, one torch
thread per rank. Rounds alternate the variants so that drift on a shared machine hits them
alike; the median is taken over every timed step of a variant (rank 0's wall clock, from the
start of one step to the start of the next, so deferred work is counted).

With --replicate-every N the ZeRO stage also runs with buddy replication every N steps, as the
worker does it: overlapped (the snapshot is copied to host memory after the step and swapped with
the buddy over a host gloo group while the next step computes) and, for comparison, synchronous
(the swap waited for at once). The blocking time of a replicating step is what the training thread
spends on replication: the copy (made by the engine as it updates), and the wait for the previous
swap to arrive.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from elastic_zero.worker.replication import Replicator
from elastic_zero.zero.comm import TorchComm, new_process_group
from elastic_zero.zero.host_memory import building

from elastic_zero.bench.baselines import ADAMW, default_group, fsdp2
from elastic_zero.data import MarkovTokens
from elastic_zero.testing.local_group import LocalRank, run_local_group
from elastic_zero.models import PRESETS, build_preset, lm_loss
from elastic_zero.zero import AdamW, ZeroEngine

VARIANTS = ("ddp", "1", "2", "3", "fsdp2")


OVERLAPPED, SYNCHRONOUS = "+replicas", "+replicas-sync"  # variant suffixes: a ZeRO stage with replication


class _Trainer:
    """One variant on one rank: step(x, y) runs forward, backward and the optimizer (and, for a
    replicating variant, the replication; its blocking seconds go to `blocked`)."""

    def __init__(self, variant: str, preset: str, zero_pg, host_comm=None, replicate_every: int = 0) -> None:
        model = build_preset(preset, seed=0)
        self.engine = None
        self.blocked: list[float] = []
        stage = variant.split("+")[0]
        if stage in ("1", "2", "3"):
            self.engine = ZeroEngine(model, AdamW(**ADAMW), stage=int(stage), process_group=zero_pg)
            self.model = model
            self.replicate = variant[len(stage):]
            self.host, self.every, self.replicator = host_comm, replicate_every, Replicator()
            n = host_comm.world_size if host_comm is not None else 1
            self.buddies = [(r + 1) % n for r in range(n)]
            return
        if variant == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model)
        elif variant == "fsdp2":
            self.model = fsdp2(model)
        else:
            raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW, foreach=True)

    def step(self, x, y) -> float:
        loss = lm_loss(self.model(x), y)
        if self.engine is not None:
            self.engine.backward(loss)
            replicating = bool(self.replicate) and (self.engine.step_count + 1) % self.every == 0
            self.engine.step(host_copy=replicating)
            self.engine.zero_grad()
            if self.replicate:
                self._replicate()
        else:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def _replicate(self) -> None:
        """What the worker's loop does after a step (worker/trainer.py): collect the previous swap,
        then, every `every` steps, copy the shard and start the next (waited for at once if synchronous)."""
        started = time.perf_counter()
        self.replicator.finish()
        copy_s = 0.0
        if self.engine.step_count % self.every == 0:
            snapshot, copied, copy_s = self.engine.take_host_copy()  # made by the step as it updated
            self.replicator.start(self.host, self.engine.step_count, snapshot, copied, self.buddies, [])
            if self.replicate == SYNCHRONOUS:
                self.replicator.finish()
        self.blocked.append(time.perf_counter() - started + copy_s)

    def finish(self) -> None:
        if self.engine is not None:
            self.replicator.finish()
            self.engine.synchronize()


def _rank_main(ctx: LocalRank, variants, preset, micro_batch, warmup, steps, rounds, replicate_every=0):
    with default_group(ctx, "bench-default/"):
        cfg = PRESETS[preset]
        data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
        host = None
        if replicate_every:
            host = TorchComm(new_process_group(ctx.store, "bench-host/", ctx.rank, ctx.world_size), role="host")
        # the workers' memory rules (worker/entry.py): the steps and the replicas cost here what they cost there
        with building():
            trainers = {v: _Trainer(v, preset, ctx.process_group, host, replicate_every) for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        blocked_from: dict[str, int] = {v: 0 for v in variants}
        blocked: dict[str, list[float]] = {v: [] for v in variants}
        cursor = {v: 0 for v in variants}
        per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
        for r, timed in enumerate(per_round):
            for v in variants:
                t = trainers[v]
                n_warm = warmup if r == 0 else 1
                stamps = []
                dist.barrier()
                for i in range(n_warm + timed):
                    start = (cursor[v] * ctx.world_size + ctx.rank) * micro_batch
                    x, y = data.batch(range(start, start + micro_batch))
                    cursor[v] += 1
                    if i == n_warm:
                        blocked_from[v] = len(t.blocked)
                    if i >= n_warm:
                        stamps.append(time.perf_counter())
                    t.step(x, y)
                t.finish()
                stamps.append(time.perf_counter())
                times[v].extend(b - a for a, b in zip(stamps, stamps[1:]))
                blocked[v].extend(t.blocked[blocked_from[v]:])
        memory = {v: trainers[v].engine.memory_report() for v in variants if trainers[v].engine is not None}
        return {"times": times, "memory": memory, "blocked": blocked}


def run_step_bench(stage: str, workers: int, preset: str = "gpt-small", micro_batch: int = 8,
                   warmup: int = 3, steps: int = 30, rounds: int = 3, replicate_every: int = 0) -> dict:
    if stage not in VARIANTS:
        raise ValueError(f"--stage must be one of {', '.join(VARIANTS)}, got {stage!r}")
    if workers < 1 or steps < rounds or rounds < 1 or warmup < 0:
        raise ValueError("need workers >= 1, rounds >= 1, steps >= rounds and warmup >= 0")
    if replicate_every < 0 or (replicate_every and (stage not in ("1", "2", "3") or workers < 2)):
        raise ValueError("--replicate-every needs a ZeRO --stage (1, 2 or 3), --workers >= 2 and a value >= 0")
    variants = ["ddp"] + ([stage] if stage != "ddp" else [])
    if stage == "3":
        variants.append("fsdp2")
    if replicate_every:
        variants += [stage + OVERLAPPED, stage + SYNCHRONOUS]
    results = run_local_group(_rank_main, workers,
                              (variants, preset, micro_batch, warmup, steps, rounds, replicate_every), timeout_s=3600)
    times, memory = results[0]["times"], results[0]["memory"]
    medians = {v: statistics.median(ts) for v, ts in times.items()}
    report = {
        "stage": stage,
        "workers": workers,
        "preset": preset,
        "micro_batch": micro_batch,
        "timed_steps": steps,
        "median_step_s": medians[stage],
        "ddp_median_step_s": medians["ddp"],
        "ratio_vs_ddp": medians[stage] / medians["ddp"],
    }
    if "fsdp2" in medians:
        report["fsdp2_median_step_s"] = medians["fsdp2"]
        report["ratio_vs_fsdp2"] = medians[stage] / medians["fsdp2"]
    if replicate_every:
        # the blocking time of every timed step, the slowest rank's (it sets the pace); with
        # --replicate-every N > 1 the steps between replicas block only to collect the last swap
        for suffix, key in ((OVERLAPPED, "overlapped"), (SYNCHRONOUS, "synchronous")):
            v = stage + suffix
            per_step = [max(b) for b in zip(*(r["blocked"][v] for r in results))]
            report[f"replicas_{key}_median_step_s"] = medians[v]
            report[f"replicas_{key}_blocking_median_s"] = statistics.median(per_step)
            report[f"replicas_{key}_blocking_share"] = statistics.median(per_step) / medians[stage]
            report[f"replicas_{key}_ratio_vs_off"] = medians[v] / medians[stage]
        report["replicate_every"] = replicate_every
    if stage in memory:
        mem = memory[stage]
        p, n = mem["param_count"], workers
        s = int(stage)
        theory = {
            "params": 4 * p if s < 3 else 4 * p / n,
            "grads": 4 * p + 4 * p / n if s == 1 else 4 * p / n,
            "optimizer": 8 * p / n,
        }
        report.update(
            param_count=p,
            optimizer_bytes_per_rank=mem["optimizer"],
            optimizer_bytes_theory=theory["optimizer"],
            optimizer_ratio_vs_theory=mem["optimizer"] / theory["optimizer"],
            params_bytes_per_rank=mem["params"],
            params_bytes_theory=theory["params"],
            grads_bytes_per_rank=mem["grads"],
            grads_bytes_theory=theory["grads"],
        )
    return report


def format_report(r: dict) -> str:
    lines = [
        f"bench step: {r['preset']}, micro batch {r['micro_batch']}, {r['workers']} gloo ranks, "
        f"{r['timed_steps']} timed steps per variant",
        f"  torch DDP        median {r['ddp_median_step_s']:.3f} s/step",
    ]
    if r["stage"] != "ddp":
        lines.append(f"  ZeRO stage {r['stage']}     median {r['median_step_s']:.3f} s/step   "
                     f"{r['ratio_vs_ddp']:.3f}x DDP")
    if "fsdp2_median_step_s" in r:
        lines.append(f"  FSDP2            median {r['fsdp2_median_step_s']:.3f} s/step   "
                     f"stage 3 is {r['ratio_vs_fsdp2']:.3f}x FSDP2")
    if "replicate_every" in r:
        lines.append(f"  replicas every {r['replicate_every']} step(s), to the buddy over a host gloo group:")
        for key, text in (("overlapped", "overlapped "), ("synchronous", "synchronous")):
            lines.append(f"    {text}    median {r[f'replicas_{key}_median_step_s']:.3f} s/step   "
                         f"{r[f'replicas_{key}_ratio_vs_off']:.3f}x no replicas   blocking median "
                         f"{r[f'replicas_{key}_blocking_median_s'] * 1e3:.1f} ms/step = "
                         f"{r[f'replicas_{key}_blocking_share'] * 100:.1f}% of the step")
    if "optimizer_bytes_per_rank" in r:
        for cat in ("optimizer", "params", "grads"):
            got, want = r[f"{cat}_bytes_per_rank"], r[f"{cat}_bytes_theory"]
            lines.append(f"  {cat:<10} {got / 2**20:8.2f} MiB/rank   ZeRO formula {want / 2**20:8.2f} MiB "
                         f"({got / want:.4f}x)")
    return "\n".join(lines)
