"""A ZeRO training run on local gloo ranks, with no Ray: the embedded default job of `elastic-zero run`."""

from __future__ import annotations

import time

from elastic_zero.data import MarkovTokens
from elastic_zero.local_group import LocalRank, run_local_group
from elastic_zero.models import PRESETS, build_preset, lm_loss
from elastic_zero.zero import AdamW, WarmupCosine, ZeroEngine


def _rank_main(ctx: LocalRank, preset, stage, steps, global_batch, micro_batch, lr, seed):
    cfg = PRESETS[preset]
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=seed)
    model = build_preset(preset, seed=seed)
    opt = AdamW(lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                schedule=WarmupCosine(warmup_steps=max(1, steps // 10), total_steps=steps))
    engine = ZeroEngine(model, opt, stage=stage, process_group=ctx.process_group, grad_clip=1.0)
    share = global_batch // ctx.world_size
    accum = -(-share // micro_batch)
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        first = step * global_batch + ctx.rank * share
        x, y = data.batch(range(first, first + share))
        total = 0.0
        for i, (mx, my) in enumerate(zip(x.split(micro_batch), y.split(micro_batch))):
            loss = lm_loss(engine.module(mx), my) * (mx.shape[0] / share)
            engine.backward(loss, sync=i == accum - 1)
            total += loss.item()
        engine.step()
        engine.zero_grad()
        losses.append(total)
        if ctx.rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step + 1:4d}/{steps}  loss {total:.4f}  grad norm {engine.last_grad_norm:.3f}  "
                  f"{time.perf_counter() - started:6.1f} s", flush=True)
    return {"losses": losses, "memory": engine.memory_report(), "seconds": time.perf_counter() - started}


def train_local(preset: str = "gpt-small", workers: int = 2, stage: int = 2, steps: int = 30,
                global_batch: int = 16, micro_batch: int = 8, lr: float = 3e-3, seed: int = 0) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")
    if global_batch % workers:
        raise ValueError(f"global batch {global_batch} must divide evenly over {workers} workers")
    results = run_local_group(_rank_main, workers, (preset, stage, steps, global_batch, micro_batch, lr, seed),
                              timeout_s=3600)
    return results[0]
