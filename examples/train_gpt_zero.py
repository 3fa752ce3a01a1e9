"""Train the small GPT with ZeroEngine under torchrun (or on one process without it).

    torchrun --nproc-per-node 2 examples/train_gpt_zero.py --stage 3 --steps 20
    python examples/train_gpt_zero.py --preset gpt-tiny --steps 20
"""

import argparse
import os

import torch
import torch.distributed as dist

from elastic_zero.data import MarkovTokens
from elastic_zero.models import PRESETS, build_preset, lm_loss
from elastic_zero.zero import AdamW, WarmupCosine, ZeroEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--save", help="write the final weights here (a plain torch state dict)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    pg = None
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        pg = dist.group.WORLD
    rank, world = (dist.get_rank(), dist.get_world_size()) if pg is not None else (0, 1)

    cfg = PRESETS[args.preset]
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    optimizer = AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                      schedule=WarmupCosine(warmup_steps=2, total_steps=args.steps))
    engine = ZeroEngine(build_preset(args.preset, seed=0), optimizer, stage=args.stage, process_group=pg,
                        grad_clip=1.0, compute_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    b = args.batch_per_rank
    for step in range(args.steps):
        first = (step * world + rank) * b
        x, y = data.batch(range(first, first + b))
        loss = lm_loss(engine.module(x), y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    state = engine.full_state_dict(rank0_only=True)
    if rank == 0:
        print(f"final: {len(state)} tensors; memory per rank: {engine.memory_report()}")
        if args.save:
            torch.save(state, args.save)
    engine.close()  # release the group before destroying it
    if pg is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
