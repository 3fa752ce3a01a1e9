"""The `elastic-zero` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The embedded default job of `elastic-zero run` with no spec: the small GPT on 3 workers, one of
# which is killed at step 10; the survivors go on at 2 and a replacement joins when it is ready.
DEFAULT_JOB = {
    "name": "demo",
    "model": {"preset": "gpt-small"},
    "train": {"steps": 30, "global_batch": 24, "micro_batch": 8},
    "optimizer": {"name": "adamw", "lr": 3e-3, "schedule": "warmup_cosine", "warmup_steps": 3},
    "zero": {"stage": 2},
    "elastic": {"workers": 3, "min_workers": 1, "max_workers": 3},
    "faults": [{"at_step": 10, "action": "kill", "rank": 1}],
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-zero", description="Elastic ZeRO training for PyTorch on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job to the end in the foreground (an embedded local Ray without --address)")
    run.add_argument("spec", nargs="?", help="the job's TOML file (default: the embedded demo job)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    run.add_argument("--run-dir", help="where summary.json and events.jsonl go (default: runs/NAME-TIME)")
    run.add_argument("--address", help="the Ray cluster to join (default: start an embedded local Ray)")
    run.add_argument("--final-weights", metavar="PATH", help="save the final model as a plain torch state dict")

    for name, text in (("scale", "ask a running job for another number of workers"),
                       ("status", "show a running job's generation and workers")):
        c = sub.add_parser(name, help=text)
        c.add_argument("job", help="the job's name")
        if name == "scale":
            c.add_argument("workers", type=int)
        c.add_argument("--address", default="auto")

    plot = sub.add_parser("plot", help="draw a run's loss, samples/s and world size, with its events, into a PNG")
    plot.add_argument("run_dir", help="a run's directory (summary.json and events.jsonl)")
    plot.add_argument("--out", help="the PNG to write (default: RUN_DIR/run.png)")

    ckpt = sub.add_parser("checkpoint", help="list, inspect and export sharded checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    for name, text in (("ls", "committed checkpoints under URI"), ("inspect", "one checkpoint's contents"),
                       ("export", "write a checkpoint's weights as a plain torch state dict")):
        c = ckpt_sub.add_parser(name, help=text)
        c.add_argument("uri")
        if name != "ls":
            c.add_argument("--step", default="latest", help="a step number or 'latest'")
        if name == "export":
            c.add_argument("--out", required=True, metavar="FILE.pt")

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
    rec = bench_sub.add_parser("recovery", help="kill a worker here and in a Ray Train elastic TorchTrainer")
    rec.add_argument("--workers", type=int, default=3)
    rec.add_argument("--preset", default="gpt-small")
    rec.add_argument("--steps", type=int, default=24)
    rec.add_argument("--kill-step", type=int, default=8)
    rec.add_argument("--micro-batch", type=int, default=8)
    rec.add_argument("--checkpoint-every", type=int, default=5)
    rec.add_argument("--json", action="store_true", help="print one JSON object")
    chaos = bench_sub.add_parser("chaos", help="the chaos drill: seeded faults, checked against a fault-free run")
    chaos.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    chaos.add_argument("--steps", type=int, default=300)
    chaos.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    chaos.add_argument("--checkpoint-every", type=int, default=20)
    chaos.add_argument("--workdir", default="runs/chaos")
    chaos.add_argument("--json", action="store_true", help="print one JSON object")
    ck = bench_sub.add_parser("checkpoint", help="sharded checkpoints against torch.distributed.checkpoint")
    ck.add_argument("--preset", default="gpt-small")
    ck.add_argument("--save-workers", type=int, default=2)
    ck.add_argument("--load-workers", type=int, default=3)
    ck.add_argument("--rounds", type=int, default=3)
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    data = bench_sub.add_parser("data", help="the workers' streaming data path against a plain pyarrow.dataset scan")
    data.add_argument("--size-gb", type=float, default=2.0, help="the generated dataset's int32 tokens, in GB")
    data.add_argument("--dir", default="runs/bench-data", help="where the dataset is generated (and reused)")
    data.add_argument("--format", default="ipc", choices=("ipc", "parquet"))
    data.add_argument("--seq-len", type=int, default=1024, help="a row holds seq_len + 1 tokens")
    data.add_argument("--batch-rows", type=int, default=2048, help="rows of a record batch (Parquet row group)")
    data.add_argument("--workers", type=int, default=2)
    data.add_argument("--global-batch", type=int, default=64)
    data.add_argument("--rounds", type=int, default=3)
    data.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _run(args, started_at: float) -> int:
    # the user's modules named in the spec ("pkg.module:fn") are found from the working directory,
    # as with `python -m`; Ray gives its workers the driver's working directory on their path too
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from elastic_zero.api import run_job
    from elastic_zero.spec import apply_override, load_spec, spec_from_dict

    if args.spec:
        spec = load_spec(args.spec, args.overrides)
    else:
        data = json.loads(json.dumps(DEFAULT_JOB))
        for assignment in args.overrides:
            apply_override(data, assignment)
        spec = spec_from_dict(data)
    # run() checks the spec's paths, data and functions before Ray starts: a SpecError, exit 2
    return run_job(spec, args.run_dir, args.address, args.final_weights, started_at)


def _control(args) -> int:
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name

    ray.init(address=args.address, namespace=NAMESPACE, logging_level="ERROR")
    try:
        actor = ray.get_actor(coordinator_name(args.job), namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no running job named {args.job!r} on this Ray cluster") from None
    if args.command == "scale":
        print(ray.get(actor.scale.remote(args.workers)))
    else:
        print(json.dumps(ray.get(actor.status.remote())))
    return 0


def _checkpoint(args) -> int:
    from elastic_zero.checkpoint import export_state_dict, list_checkpoints, open_store, read_manifest, resolve

    fs, root = open_store(args.uri)
    if args.action == "ls":
        for step, directory in list_checkpoints(fs, root):
            m = read_manifest(fs, directory)
            print(f"step {step:>8}  world size {m.world_size}  stage {m.stage}  {m.nbytes / 2**20:9.2f} MiB  {directory}")
        return 0
    directory = resolve(fs, root, args.step)
    if args.action == "inspect":
        m = read_manifest(fs, directory)
        layout = m.layout
        print(json.dumps({
            "directory": directory, "step": m.step, "world_size": m.world_size, "stage": m.stage, "bytes": m.nbytes,
            "vectors": m.vectors, "scalars": m.scalars, "extra": m.extra,
            "layout": {"parameters": len(layout["slots"]), "units": len(layout["units"]),
                       "elements": sum(s["numel"] for s in layout["slots"]), "align": layout["align"],
                       "first": [f"{s['name']} {tuple(s['shape'])}" for s in layout["slots"][:5]]},
            "files": [{"path": f.path, "rank": f.rank, "bytes": f.nbytes} for f in m.files],
        }, indent=1))
        return 0
    import torch

    state = export_state_dict(fs, directory)
    torch.save(state, args.out)
    print(f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values())} parameters) to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args, started_at)
        if args.command in ("scale", "status"):
            return _control(args)
        if args.command == "checkpoint":
            return _checkpoint(args)
        if args.command == "plot":
            from elastic_zero.plot import plot_run

            out, series = plot_run(args.run_dir, args.out)
            print(f"{out}: {series.last_step} steps, {len(series.marks)} events marked")
            return 0
        if args.command == "bench" and args.bench == "step":
            from elastic_zero.bench.step import format_report, run_step_bench

            report = run_step_bench(args.stage, args.workers, args.preset, args.micro_batch,
                                    args.warmup, args.steps, args.rounds)
            print(json.dumps(report) if args.json else format_report(report))
            return 0
        if args.command == "bench" and args.bench == "recovery":
            from elastic_zero.bench.recovery import format_recovery, run_recovery_bench

            report = run_recovery_bench(args.preset, args.workers, args.steps, args.kill_step, args.micro_batch,
                                        args.checkpoint_every)
            print(json.dumps(report) if args.json else format_recovery(report))
            return 0
        if args.command == "bench" and args.bench == "chaos":
            from elastic_zero.bench.chaos import format_chaos, run_chaos

            report = run_chaos([int(x) for x in args.seeds.split(",")], args.steps,
                               [int(x) for x in args.stages.split(",")], args.workdir, args.checkpoint_every)
            print(json.dumps(report) if args.json else format_chaos(report))
            return 0 if not report["failed_runs"] else 1
        if args.command == "bench" and args.bench == "checkpoint":
            from elastic_zero.bench.checkpoint import format_checkpoint, run_checkpoint_bench

            report = run_checkpoint_bench(args.preset, args.save_workers, args.load_workers, args.rounds)
            print(json.dumps(report) if args.json else format_checkpoint(report))
            return 0
        if args.command == "bench" and args.bench == "data":
            from elastic_zero.bench.data import format_data_report, run_data_bench

            report = run_data_bench(args.size_gb, args.dir, args.format, args.seq_len, args.workers,
                                    args.global_batch, args.rounds, args.batch_rows)
            print(json.dumps(report) if args.json else format_data_report(report))
            return 0
    except ValueError as exc:  # SpecError included: one line, exit 2
        print(f"elastic-zero: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
