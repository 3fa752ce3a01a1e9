"""The `elastic-zero` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-zero", description="Elastic ZeRO training for PyTorch on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the embedded default job: ZeRO training of the small GPT on local ranks")
    run.add_argument("--preset", default="gpt-small")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--global-batch", type=int, default=16)
    run.add_argument("--micro-batch", type=int, default=8)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    step = bench_sub.add_parser("step", help="ZeRO step time against torch DDP (and FSDP2) in one run")
    step.add_argument("--stage", required=True, choices=("ddp", "1", "2", "3", "fsdp2"))
    step.add_argument("--workers", type=int, default=2)
    step.add_argument("--preset", default="gpt-small")
    step.add_argument("--micro-batch", type=int, default=8)
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--steps", type=int, default=30)
    step.add_argument("--rounds", type=int, default=3)
    step.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            from elastic_zero.local_train import train_local

            out = train_local(args.preset, args.workers, args.stage, args.steps, args.global_batch, args.micro_batch)
            losses = out["losses"]
            print(f"done: {len(losses)} steps on {args.workers} ranks, ZeRO stage {args.stage}, "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {out['seconds']:.1f} s")
            return 0
        if args.command == "bench" and args.bench == "step":
            from elastic_zero.bench.step import format_report, run_step_bench

            report = run_step_bench(args.stage, args.workers, args.preset, args.micro_batch,
                                    args.warmup, args.steps, args.rounds)
            print(json.dumps(report) if args.json else format_report(report))
            return 0
    except ValueError as exc:
        print(f"elastic-zero: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
