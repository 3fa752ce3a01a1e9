"""`elastic-zero bench ...`: the benchmarks' arguments and how each is run and printed. Each bench lives
in a module of its own beside this one; each imports what it needs (torch, Ray) when it runs."""

from __future__ import annotations

import json

from elastic_zero.bench.chaos_schedule import KINDS as CHAOS_KINDS, MORE_KINDS as CHAOS_MORE_KINDS


def add_bench_parsers(sub) -> None:
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
    step.add_argument("--replicate-every", type=int, default=0,
                      help="also time the stage with buddy replicas every N steps, overlapped and synchronous")
    step.add_argument("--json", action="store_true", help="print one JSON object")
    ov = bench_sub.add_parser("overhead", help="the job's step against the bare engine's at N workers, and where "
                                               "the cores went (workers, the job's side processes, Ray, idle)")
    ov.add_argument("--workers", type=int, default=4)
    ov.add_argument("--preset", default="gpt-small")
    ov.add_argument("--stage", type=int, default=2)
    ov.add_argument("--micro-batch", type=int, default=4)
    ov.add_argument("--warmup", type=int, default=5)
    ov.add_argument("--steps", type=int, default=60)
    ov.add_argument("--rounds", type=int, default=2)
    ov.add_argument("--json", action="store_true", help="print one JSON object")
    rec = bench_sub.add_parser("recovery", help="kill a worker here and in a Ray Train elastic TorchTrainer")
    rec.add_argument("--workers", type=int, default=3)
    rec.add_argument("--preset", default="gpt-small")
    rec.add_argument("--steps", type=int, default=24)
    rec.add_argument("--kill-step", type=int, default=8, help="the step the fault hits rank 1 at")
    rec.add_argument("--fault", default="kill", help="kill (beside --against), or hang, hang_in_data, "
                     "hang_in_collective, kill_coordinator: beside a kill and the fault-free job, ours only")
    rec.add_argument("--micro-batch", type=int, default=8)
    rec.add_argument("--checkpoint-every", type=int, default=5)
    rec.add_argument("--against", default="ray-train", help="ray-train or torchft (pip install -e '.[anchors]')")
    rec.add_argument("--json", action="store_true", help="print one JSON object")
    nl = bench_sub.add_parser("node-loss", help="freeze a whole node of a local multi-node cluster, with and "
                                                "without heartbeats")
    nl.add_argument("--preset", default="gpt-small")
    nl.add_argument("--trials", type=int, default=3)
    nl.add_argument("--steps", type=int, default=400)
    nl.add_argument("--freeze-after", type=int, default=10, help="freeze once the job passed this step")
    nl.add_argument("--collective-timeout", type=float, default=30.0)
    nl.add_argument("--seed", type=int, default=0)
    nl.add_argument("--heartbeats-only", action="store_true", help="skip the runs without heartbeats")
    nl.add_argument("--json", action="store_true", help="print one JSON object")
    gp = bench_sub.add_parser("goodput", help="one seeded schedule of node losses, a preemption notice and new "
                                               "nodes, played to elastic_zero and to Ray Train elastic")
    gp.add_argument("--preset", default="gpt-small")
    gp.add_argument("--window", type=float, default=600.0, help="seconds from each job's launch to its stop")
    gp.add_argument("--seed", type=int, default=0)
    gp.add_argument("--notice", type=float, default=30.0, help="the preemption notice's deadline, seconds")
    gp.add_argument("--checkpoint-every", type=int, default=20)
    gp.add_argument("--systems", default=None, help="comma-separated: elastic_zero, ray_train, torchft "
                                                     "(default: elastic_zero,ray_train)")
    gp.add_argument("--against", default=None, help="ray-train or torchft: elastic_zero and that peer "
                                                     "(torchft: pip install -e '.[anchors]')")
    gp.add_argument("--torchft-stock-ddp-hook", action="store_true",
                    help="torchft's DDP comm hook as released, which ends a group whose all-reduce fails")
    gp.add_argument("--clock", default="launch", choices=("launch", "first_step"),
                    help="the schedule counts from each job's launch (default) or from its first step")
    gp.add_argument("--autoscaler", action="store_true",
                    help="a schedule of its own on clusters whose nodes Ray's autoscaler starts and stops: "
                         "a node reclaimed, another noticed and reclaimed at its deadline, nothing added by hand")
    gp.add_argument("--json", action="store_true", help="print one JSON object")
    su = bench_sub.add_parser("startup", help="where the time to the first step goes, against Ray Train")
    su.add_argument("--preset", default="gpt-small")
    su.add_argument("--workers", type=int, default=3)
    su.add_argument("--rounds", type=int, default=3)
    su.add_argument("--json", action="store_true", help="print one JSON object")
    chaos = bench_sub.add_parser("chaos", help="the chaos drill: seeded faults, checked against a fault-free run")
    chaos.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    chaos.add_argument("--steps", type=int, default=300)
    chaos.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    chaos.add_argument("--checkpoint-every", type=int, default=20)
    chaos.add_argument("--workdir", default="runs/chaos")
    chaos.add_argument("--replicate-every", default=None,
                       help='elastic.replicate_every for the drill: an integer or "auto" (default: the example\'s, 1)')
    chaos.add_argument("--standby-workers", type=int, default=0,
                       help="elastic.standby_workers for the drill, 0-4 (default 0): losses and scale-ups take them")
    chaos.add_argument("--faults", default=",".join(CHAOS_KINDS),
                       help="comma-separated fault kinds, or all (adds " + ", ".join(CHAOS_MORE_KINDS) + ")")
    chaos.add_argument("--json", action="store_true", help="print one JSON object")
    ck = bench_sub.add_parser("checkpoint", help="sharded checkpoints against torch.distributed.checkpoint")
    ck.add_argument("--preset", default="gpt-small")
    ck.add_argument("--save-workers", type=int, default=2)
    ck.add_argument("--load-workers", type=int, default=3)
    ck.add_argument("--rounds", type=int, default=3)
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    so = bench_sub.add_parser("save-overlap", help="what a checkpoint's background write costs a GIL-bound "
                                                   "training thread beside it")
    so.add_argument("--numel", type=int, default=100_000_000, help="the shard's fp32 elements (x3 with the moments)")
    so.add_argument("--rounds", type=int, default=4)
    so.add_argument("--dir", default=None, help="where the save is written (default: the system's temp directory)")
    so.add_argument("--json", action="store_true", help="print one JSON object")
    pin = bench_sub.add_parser("pinning", help="the ways of making a first host copy's pinned buffers, side by side "
                                               "(CUDA; without it, fresh pages written by 1 and N threads)")
    pin.add_argument("--mib", type=int, default=1424, help="the buffers' total size (default: GPT-2 124M's fp32 "
                                                           "master and AdamW moments)")
    pin.add_argument("--buffers", type=int, default=3)
    pin.add_argument("--threads", type=int, default=None, help="threads a way may use (default: up to 8, the cores)")
    pin.add_argument("--rounds", type=int, default=2)
    pin.add_argument("--json", action="store_true", help="print one JSON object")
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
    mem = bench_sub.add_parser("memory", help="every process's peak RSS through a job of a GPT of real size, "
                                              "and of exporting its weights")
    _gpt_job_arguments(mem, layers=24, workers=2)
    mem.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    mem.add_argument("--replicate-every", type=int, default=0, help="0: no buddy replicas (see the spec)")
    mem.add_argument("--meta", action="store_true", help="build the model's parameters on the meta device")
    mem.add_argument("--steps", type=int, default=3)
    mem.add_argument("--global-batch", type=int, default=4)
    mem.add_argument("--micro-batch", type=int, default=2)
    mem.add_argument("--memory-per-node-gib", type=float, default=None,
                     help="elastic.memory_per_node_gib: the most the job's workers may hold on the node together")
    mem.add_argument("--json", action="store_true", help="print one JSON object")
    gpu = bench_sub.add_parser("gpu", help="on one device: torch, the bare engine and the job side by side, with "
                                           "replicas, checkpoints and a recovery (no CUDA: tiny shapes on the CPU)")
    gpu.add_argument("--models", default=None, help="comma-separated shapes: 124m, 355m, small, tiny (default: "
                                                    "124m,355m on CUDA, tiny on the CPU)")
    gpu.add_argument("--micro-batch", type=int, default=None, help="samples a step (default: 8 on CUDA, 4 on the CPU)")
    gpu.add_argument("--steps", type=int, default=None, help="steps of each job (default: 40 on CUDA, 32 on the CPU)")
    gpu.add_argument("--save-every", type=int, default=10, help="the checkpointing job's checkpoint.every")
    gpu.add_argument("--json", action="store_true", help="print one JSON object")
    gpu.add_argument("--partial", default=None, metavar="FILE",
                     help="write the figures so far to FILE after each measurement (a run cut short keeps them)")
    size = bench_sub.add_parser("state-size", help="every process's memory through every elastic event of a GPT of "
                                                   "real size, and each event's bytes per second against the links'")
    _gpt_job_arguments(size, layers=16, workers=3)
    size.add_argument("--resume-workers", type=int, default=2, help="the world size the checkpoint is resumed at")
    size.add_argument("--replicate-every", type=int, default=3, help="steps between replica swaps (>= 1)")
    size.add_argument("--steps", type=int, default=18)
    size.add_argument("--global-batch", type=int, default=6)
    size.add_argument("--micro-batch", type=int, default=2)
    size.add_argument("--real", action="store_true", help="build the model for real, not on the meta device")
    size.add_argument("--json", action="store_true", help="print one JSON object")
    st = bench_sub.add_parser("status", help="`status` over the dashboard's address: the published record against "
                                             "a control job, on a real Ray head")
    st.add_argument("--rounds", type=int, default=5, help="calls of each way (>= 1)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    cp = bench_sub.add_parser("control-plane", help="the real coordinator driving many simulated workers: liveness, "
                                                    "recovery, joiners, notices, rendezvous, status, at each size")
    cp.add_argument("--workers", default="16,64,256,1024", help="comma-separated sizes, one run each")
    cp.add_argument("--per-node", type=int, default=8, help="simulated workers per node")
    cp.add_argument("--steady", type=float, default=60.0, help="seconds of steady state measured")
    cp.add_argument("--step", type=float, default=0.25, help="the simulated step's seconds")
    cp.add_argument("--real", default="3,12", help="also the coordinator's CPU on real gpt-tiny jobs of these "
                                                   "sizes (comma-separated; empty: none)")
    cp.add_argument("--real-seconds", type=float, default=60.0,
                    help="how long the real jobs' CPU is sampled (15 s of 10 ms ticks resolve only 74 us per second "
                         "per worker between 3 and 12)")
    cp.add_argument("--json", action="store_true", help="print one JSON object")


def _gpt_job_arguments(parser, layers: int, workers: int) -> None:
    """The shape of the memory benches' GPT (GPT-2 medium's widths) and the job's workers."""
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--workers", type=int, default=workers)


def run_bench(args) -> int:
    if args.bench == "step":
        from elastic_zero.bench.step import format_report, run_step_bench

        report = run_step_bench(args.stage, args.workers, args.preset, args.micro_batch,
                                args.warmup, args.steps, args.rounds, args.replicate_every)
        print(json.dumps(report) if args.json else format_report(report))
        return 0
    if args.bench == "overhead":
        from elastic_zero.bench.job_overhead import format_overhead, run_overhead_bench

        report = run_overhead_bench(args.workers, args.preset, args.stage, args.micro_batch, args.warmup, args.steps,
                                    args.rounds)
        print(json.dumps(report) if args.json else format_overhead(report))
        return 0
    if args.bench == "recovery" and args.fault == "kill_coordinator":
        from elastic_zero.bench.coordinator_loss import format_coordinator_loss, run_coordinator_loss_bench

        report = run_coordinator_loss_bench(args.preset, args.workers, args.steps, args.kill_step, args.micro_batch)
        print(json.dumps(report) if args.json else format_coordinator_loss(report))
        return 0
    if args.bench == "recovery" and args.fault != "kill":
        from elastic_zero.bench.hang import format_hang, run_hang_bench

        report = run_hang_bench(args.fault, args.preset, args.workers, args.steps, args.kill_step, args.micro_batch)
        print(json.dumps(report) if args.json else format_hang(report))
        return 0
    if args.bench == "recovery":
        from elastic_zero.bench.recovery import format_recovery, run_recovery_bench

        report = run_recovery_bench(args.preset, args.workers, args.steps, args.kill_step, args.micro_batch,
                                    args.checkpoint_every, args.against)
        print(json.dumps(report) if args.json else format_recovery(report))
        return 0
    if args.bench == "node-loss":
        from elastic_zero.bench.node_loss import format_node_loss, run_node_loss_bench

        report = run_node_loss_bench(args.preset, args.trials, args.steps, args.freeze_after,
                                     args.collective_timeout, args.seed, not args.heartbeats_only)
        print(json.dumps(report) if args.json else format_node_loss(report))
        return 0
    if args.bench == "goodput":
        from elastic_zero.bench.goodput import format_goodput, goodput_systems, run_goodput_bench

        report = run_goodput_bench(args.preset, args.window, args.seed, args.notice, args.checkpoint_every,
                                   goodput_systems(args.systems, args.against), clock=args.clock,
                                   torchft_stock_ddp_hook=args.torchft_stock_ddp_hook, autoscaler=args.autoscaler)
        print(json.dumps(report) if args.json else format_goodput(report))
        return 0
    if args.bench == "startup":
        from elastic_zero.bench.startup import format_startup, run_startup_bench

        report = run_startup_bench(args.preset, args.workers, args.rounds)
        print(json.dumps(report) if args.json else format_startup(report))
        return 0
    if args.bench == "chaos":
        from elastic_zero.bench.chaos import format_chaos, run_chaos

        every = args.replicate_every
        every = int(every) if every is not None and every.lstrip("-").isdigit() else every
        report = run_chaos(_integers("--seeds", args.seeds), args.steps, _integers("--stages", args.stages),
                           args.workdir, args.checkpoint_every, every, args.standby_workers, args.faults)
        print(json.dumps(report) if args.json else format_chaos(report))
        return 0 if not report["failed_runs"] else 1
    if args.bench == "checkpoint":
        from elastic_zero.bench.checkpoint import format_checkpoint, run_checkpoint_bench

        report = run_checkpoint_bench(args.preset, args.save_workers, args.load_workers, args.rounds)
        print(json.dumps(report) if args.json else format_checkpoint(report))
        return 0
    if args.bench == "data":
        from elastic_zero.bench.data import format_data_report, run_data_bench

        report = run_data_bench(args.size_gb, args.dir, args.format, args.seq_len, args.workers,
                                args.global_batch, args.rounds, args.batch_rows)
        print(json.dumps(report) if args.json else format_data_report(report))
        return 0
    if args.bench == "save-overlap":
        from elastic_zero.bench.save_overlap import format_save_overlap, run_save_overlap_bench

        report = run_save_overlap_bench(args.numel, args.rounds, args.dir)
        print(json.dumps(report) if args.json else format_save_overlap(report))
        return 0
    if args.bench == "pinning":
        from elastic_zero.bench.pinning import format_pinning, run_pinning_bench

        report = run_pinning_bench(args.mib, args.buffers, args.threads, args.rounds)
        print(json.dumps(report) if args.json else format_pinning(report))
        return 0
    if args.bench == "memory":
        from elastic_zero.bench.memory import format_memory, run_memory_bench

        report = run_memory_bench(args.d_model, args.layers, args.heads, args.vocab, args.seq_len, args.workers,
                                  args.stage, args.replicate_every, args.meta, args.steps, args.global_batch,
                                  args.micro_batch, memory_per_node_gib=args.memory_per_node_gib)
        print(json.dumps(report) if args.json else format_memory(report))
        return 0
    if args.bench == "gpu":
        from elastic_zero.bench.gpu import format_gpu, run_gpu_bench

        models = tuple(m.strip() for m in args.models.split(",") if m.strip()) if args.models else None
        report = run_gpu_bench(models, args.micro_batch, args.steps, save_every=args.save_every, partial=args.partial)
        print(json.dumps(report) if args.json else format_gpu(report))
        return 0
    if args.bench == "state-size":
        from elastic_zero.bench.state_size import format_state_size, run_state_size_bench

        report = run_state_size_bench(args.d_model, args.layers, args.heads, args.vocab, args.seq_len, args.workers,
                                      args.resume_workers, args.replicate_every, args.steps, args.global_batch,
                                      args.micro_batch, meta=not args.real)
        print(json.dumps(report) if args.json else format_state_size(report))
        return 0
    if args.bench == "status":
        from elastic_zero.bench.status import format_status_bench, run_status_bench

        report = run_status_bench(args.rounds)
        print(json.dumps(report) if args.json else format_status_bench(report))
        return 0
    if args.bench == "control-plane":
        from elastic_zero.bench.control_plane import check_arguments, run_control_plane
        from elastic_zero.bench.control_plane_report import format_control_plane

        sizes = _integers("bench control-plane: --workers", args.workers)
        real = tuple(_integers("bench control-plane: --real", args.real, blank_ok=True))
        wrong = check_arguments(sizes, args.per_node) + \
            ([f"--steady: must be > 0, got {args.steady:g}"] if args.steady <= 0 else []) + \
            ([f"--step: must be > 0, got {args.step:g}"] if args.step <= 0 else []) + \
            ([f"--real: each at least 1, got {args.real}"] if any(n < 1 for n in real) else []) + \
            ([f"--real-seconds: must be > 0, got {args.real_seconds:g}"] if args.real_seconds <= 0 else [])
        if wrong:
            raise ValueError(f"bench control-plane: {wrong[0]}")
        report = run_control_plane(sizes, args.per_node, args.steady, args.step, real, args.real_seconds)
        print(json.dumps(report) if args.json else format_control_plane(report))
        return 0
    raise ValueError(f"unknown bench {args.bench!r}")


def _integers(flag: str, text: str, blank_ok: bool = False) -> list[int]:
    """A comma-separated list of whole numbers (`blank_ok`: empty items left out), or a ValueError
    naming `flag` (one line, exit 2)."""
    try:
        return [int(x) for x in text.split(",") if not (blank_ok and not x.strip())]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated whole numbers, got {text!r}") from None
