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
    run.add_argument("--address", help="the Ray cluster to join (\"auto\", HOST:6379; default: an embedded local Ray)")
    run.add_argument("--final-weights", metavar="PATH", help="save the final model as a plain torch state dict")
    run.add_argument("--job-id", help="the job's id on the cluster, for status/scale/stop (default: its name)")
    run.add_argument("--no-progress", action="store_true", help="no progress line and no event lines")
    run.add_argument("--worker-logs", action="store_true", help="show the workers' own output on this console")
    run.add_argument("--spec-env", help=argparse.SUPPRESS)  # a submitted job's spec comes as JSON in this variable

    address_help = "the cluster's Jobs API, http://HEAD:8265 (default: $RAY_ADDRESS, else http://127.0.0.1:8265); " \
                   "\"auto\" or HOST:6379 to connect directly (a job run with `run`)"
    submit = sub.add_parser("submit", help="submit a job to a Ray cluster through its Jobs API; prints the job id")
    submit.add_argument("spec", help="the job's TOML file")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    submit.add_argument("--address", help=address_help)
    submit.add_argument("--working-dir", default=".", help="uploaded to the cluster: the modules the spec names (default: .)")
    submit.add_argument("--no-working-dir", action="store_true", help="upload nothing (the cluster has the code)")
    submit.add_argument("--run-dir", help="where the outputs go on the cluster (default: ~/elastic-zero/runs/JOB_ID)")
    submit.add_argument("--job-id", help="the job's id (default: NAME-RANDOM)")
    for name, text in (("status", "a job's state, generation, workers, step, loss, samples/s, events"),
                       ("scale", "ask a running job for another number of workers"),
                       ("stop", "stop a job at its next safe point (exit 0); --checkpoint saves one there first"),
                       ("logs", "a job's output: its progress and event lines"),
                       ("wait", "wait until a job is over; prints its last status")):
        c = sub.add_parser(name, help=text)
        c.add_argument("job", help="the job's id (as submit printed it; for `run`, its name)")
        if name == "scale":
            c.add_argument("workers", type=int)
        if name in ("status", "wait"):
            c.add_argument("--json", action="store_true", help="the status record as JSON (docs/service.md)")
        if name == "status":
            c.add_argument("--live", action="store_true",
                           help="ask the coordinator now (a control job: seconds) rather than read the record "
                                "it last published (each second or so; `as_of` says when)")
        if name == "stop":
            c.add_argument("--checkpoint", action="store_true", help="save a final checkpoint at the safe point")
        if name == "logs":
            c.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
        c.add_argument("--address", help=address_help)
    lst = sub.add_parser("list", help="the elastic-zero jobs of a Ray cluster")
    lst.add_argument("--address", help=address_help)
    lst.add_argument("--json", action="store_true")

    plot = sub.add_parser("plot", help="draw a run's loss, samples/s and world size, with its events, into a PNG")
    plot.add_argument("run_dir", help="a run's directory (summary.json and events.jsonl)")
    plot.add_argument("--out", help="the PNG to write (default: RUN_DIR/run.png)")

    ckpt = sub.add_parser("checkpoint", help="list, inspect and export sharded checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    for name, text in (("ls", "committed checkpoints under URI"), ("inspect", "one checkpoint's contents"),
                       ("export", "write a checkpoint's weights as a torch state dict (FILE.pt) or safetensors "
                                  "(FILE.safetensors); `elastic-zero export` writes Hugging Face directories too")):
        c = ckpt_sub.add_parser(name, help=text)
        c.add_argument("uri")
        if name != "ls":
            c.add_argument("--step", default="latest", help="a step number or 'latest'")
        if name == "export":
            c.add_argument("--out", required=True, metavar="FILE.pt|FILE.safetensors")

    export = sub.add_parser("export", help="write a checkpoint's weights, one tensor at a time: safetensors, "
                                           "a Hugging Face model directory, or a torch state dict")
    export.add_argument("checkpoint", help="a checkpoint directory (step-...), or a root (its latest commit); a path or URI")
    export.add_argument("out", help="the file (safetensors, torch) or the new directory (hf) to write; a path or URI")
    export.add_argument("--format", choices=("safetensors", "hf", "torch"), default="safetensors")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="hf: the largest safetensors file (GB)")

    demo = sub.add_parser("demo", help="a minute of what elastic_zero does: a kill, a preemption notice and a "
                                       "scale-up on a local Ray, a table and a plot")
    demo.add_argument("--run-dir", help="where the corpus, summary.json, events.jsonl and run.png go "
                                        "(default: runs/demo-TIME)")
    demo.add_argument("--no-progress", action="store_true", help="no progress line and no event lines")
    from elastic_zero.bench.commands import add_bench_parsers

    add_bench_parsers(sub)
    return p


def _run(args, started_at: float) -> int:
    # the user's modules named in the spec ("pkg.module:fn") are found from the working directory,
    # as with `python -m`; Ray gives its workers the driver's working directory on their path too
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from elastic_zero.api import RunConfig, run_job
    from elastic_zero.job.spec import apply_override, load_spec, spec_from_dict

    if args.spec_env:  # a submitted job: the spec was validated where it was submitted
        spec = spec_from_dict(json.loads(os.environ[args.spec_env]))
    elif args.spec:
        spec = load_spec(args.spec, args.overrides)
    else:
        data = json.loads(json.dumps(DEFAULT_JOB))
        for assignment in args.overrides:
            apply_override(data, assignment)
        spec = spec_from_dict(data)
    config = RunConfig(run_dir=args.run_dir, address=args.address, progress=not args.no_progress,
                       worker_logs=args.worker_logs)
    # run() checks the spec's paths, data and functions before Ray starts: a SpecError, exit 2
    return run_job(spec, config, args.final_weights, started_at, job_id=args.job_id)


def _service(args) -> int:
    import logging

    from elastic_zero.service.client import Client


    client = Client(args.address)
    for name in list(logging.root.manager.loggerDict):  # Ray's notes on packaging the working dir are not the user's
        if name.startswith("ray"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if args.command == "submit":
        from elastic_zero.job.spec import load_spec

        spec = load_spec(args.spec, args.overrides)
        working_dir = None if args.no_working_dir else args.working_dir
        print(client.submit(spec, working_dir=working_dir, run_dir=args.run_dir, job_id=args.job_id))
    elif args.command in ("status", "wait"):
        record = client.status(args.job, live=args.live) if args.command == "status" else client.wait(args.job)
        print(json.dumps(record, indent=1) if args.json else format_status(record))
    elif args.command == "scale":
        print(client.scale(args.job, args.workers))
    elif args.command == "stop":
        print(client.stop(args.job, checkpoint=args.checkpoint))
    elif args.command == "logs":
        for chunk in client.logs(args.job, follow=args.follow):
            print(chunk, end="" if chunk.endswith("\n") else "\n", flush=True)
    elif args.command == "list":
        rows = client.list()
        if args.json:
            print(json.dumps(rows, indent=1))
        for r in [] if args.json else rows:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["start_time"] / 1000)) if r["start_time"] else "-"
            print(f"{r['job_id']:<32} {r['name'] or '-':<20} {r['ray_job_status']:<10} {started}")
    return 0


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "-"


def format_status(r: dict) -> str:
    from elastic_zero.observe.progress import describe, hms

    def num(value, fmt):
        return format(value, fmt) if value is not None else "-"

    lines = [f"job {r['job_id']} ({r['name'] or '-'}): {r['state']}"
             + (f" (Ray job {r['ray_job_status']})" if r.get("ray_job_status") else "")
             + (f", as of {_clock(r['as_of'])}" if r.get("as_of") else "")]
    if r["generation"] is not None:
        eta = f", ETA {hms(r['eta_s'])}" if r["eta_s"] is not None else ""
        lines.append(f"generation {r['generation']}, {r['world_size']} workers (target {r['target_workers']}, "
                     f"[{r['min_workers']}, {r['max_workers']}]), step {r['step']}/{r['steps']}, loss {num(r['loss'], '.4f')}, "
                     f"{num(r['samples_per_s'], '.1f')} samples/s{eta}")
        lines.append("workers: " + ", ".join(f"{m['actor_id']} (rank {m['rank']}, node {m['node'][:12]})" for m in r["members"]))
        lines.append("world size: " + " -> ".join(f"{n} at step {'?' if s is None else s}" for s, n in r["world_size_history"]))
        standby = r.get("standby") or {}
        if standby.get("asked"):
            lines.append(f"standby workers: {standby['kept']} kept of {standby['asked']} asked"
                         + (f", {standby['short_for_room']} retired for room" if standby["short_for_room"] else ""))
        for w in [w for w in r.get("workers") or [] if w["joined_t"] is None]:  # a replacement, or a standby
            what = "starting" if w["ready_t"] is None else "ready, outside the generation"
            lines.append(f"{what}: {w['actor_id']}, asked {_clock(w['asked_t'])}, node up {_clock(w['node_up_t'])}, "
                         f"ready {_clock(w['ready_t'])}")
        lines.append(f"recoveries {r['recoveries']}, reconfigurations {r['reconfigurations']}, "
                     f"coordinator restarts {r['restarts']}, latest checkpoint {r['checkpoint'] or '-'}")
    if r.get("run_dir"):
        lines.append(f"outputs: {r['run_dir']}")
    if r.get("error"):
        lines.append(f"error: {r['error']}")
    for e in r.get("last_events") or []:
        text = describe(e)
        if text:
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['t']))} {text}")
    return "\n".join(lines)


def _checkpoint(args) -> int:
    from elastic_zero.checkpoint import list_checkpoints, open_store, read_manifest, resolve
    from elastic_zero.checkpoint.catalog import directory_uri

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
    return _export(directory_uri(args.uri, directory), args.out,
                   "safetensors" if args.out.endswith(".safetensors") else "torch")


def _export(checkpoint: str, out: str, fmt: str, max_shard_bytes: int | None = None) -> int:
    from elastic_zero.checkpoint.export import HF_SHARD_BYTES, export, open_checkpoint
    from elastic_zero.checkpoint.store import read_manifest

    try:
        written = export(checkpoint, out, fmt, max_shard_bytes or HF_SHARD_BYTES)
    except OSError as exc:  # an unwritable or full destination: nothing was left behind (export.py)
        raise ValueError(f"{out}: cannot write ({str(exc).splitlines()[0]})") from None
    fs, directory = open_checkpoint(checkpoint)
    manifest = read_manifest(fs, directory)
    params = sum(s["numel"] for s in manifest.layout["slots"])
    print(f"wrote {params} parameters of step {manifest.step} ({fmt}) to {', '.join(written)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args, started_at)
        if args.command in ("submit", "status", "scale", "stop", "logs", "wait", "list"):
            return _service(args)
        if args.command == "checkpoint":
            return _checkpoint(args)
        if args.command == "export":
            return _export(args.checkpoint, args.out, args.format, int(args.max_shard_gb * 1e9))
        if args.command == "demo":
            from elastic_zero.demo import run_demo

            return run_demo(args.run_dir, progress=not args.no_progress)
        if args.command == "plot":
            from elastic_zero.plot import plot_run

            out, series = plot_run(args.run_dir, args.out)
            print(f"{out}: {series.last_step} steps, {len(series.marks)} events marked")
            return 0
        if args.command == "bench":
            from elastic_zero.bench.commands import run_bench

            return run_bench(args)
    except ValueError as exc:  # SpecError included: one line, exit 2
        print(f"elastic-zero: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM to a driver (`run`: the job was taken down with it)
        print("elastic-zero: interrupted" + ("; the job was stopped" if args.command == "run" else ""), file=sys.stderr)
        return 130
    except RuntimeError as exc:  # the cluster: unreachable, a token refused, no such job, a refused request
        from elastic_zero.service.client import ClusterError

        if not isinstance(exc, ClusterError):
            raise
        print(f"elastic-zero: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
