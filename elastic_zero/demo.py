"""`elastic-zero demo`: what elastic_zero does, in under a minute on a laptop.

On an embedded local Ray, a byte-level GPT learns the Python standard library's own source with 3
workers; on the way one worker is killed (SIGKILL), another gets a preemption notice, and the job
is scaled up to 4. It ends with a table of what happened (each event with its stall and what it
recomputed), a line comparing the kill's stall with a restart from a checkpoint, a plot, and a few
lines the model writes from its final weights.
"""

from __future__ import annotations

import json
import os
import sys
import time

from elastic_zero.job.spec import JobSpec, spec_from_dict

# `elastic-zero bench recovery` (docs/benchmarks.md): from a kill to the next completed step under an
# elastic Ray Train TorchTrainer, which restarts its workers from the last checkpoint
RAY_TRAIN_RECOVERY_S = 18.7  # the median of three runs, 2026-11-25

CORPUS_MB = 1.0
KILL_STEP, PREEMPT_STEP, SCALE_STEP, STEPS = 10, 20, 28, 60  # a joiner takes ~8-14 steps to start here
MODEL_KWARGS = {"vocab_size": 256, "seq_len": 128, "n_layer": 4, "n_head": 4, "d_model": 128}
PROMPT, NEW_BYTES, TEMPERATURE = b"def ", 200, 0.8  # (0.6: mostly the spaces of indentation)


def demo_spec(data_dir: str) -> JobSpec:
    return spec_from_dict({
        "name": "demo",
        "model": {"preset": "gpt-tiny", "kwargs": MODEL_KWARGS},
        "data": {"source": data_dir, "column": "tokens"},
        "train": {"steps": STEPS, "global_batch": 24, "micro_batch": 8},
        "optimizer": {"name": "adamw", "lr": 3e-3, "schedule": "warmup_cosine", "warmup_steps": 6},
        "zero": {"stage": 2},
        # replicas every step: the kill loses no step (the default, "auto", would space them by this
        # machine's timings, and the kill might cost a step or two of replay)
        "elastic": {"workers": 3, "min_workers": 1, "max_workers": 4, "replicate_every": 1},
        "faults": [{"at_step": KILL_STEP, "action": "kill", "rank": 1},
                   {"at_step": PREEMPT_STEP, "action": "preempt", "rank": 0, "deadline_s": 30},
                   {"at_step": SCALE_STEP, "action": "scale", "workers": 4}],
    }).validate()


def _what(change: dict, kind: str) -> str:
    if kind == "recovery":  # the demo kills one worker at KILL_STEP; any other loss is the machine's
        how = "killed" if change.get("step") == KILL_STEP else "lost"
        cause = change.get("cause", "a failure")
        source = "a checkpoint" if change.get("source") == "checkpoint" else "replicas"
        return f"{cause.split(';')[0].replace('lost ', 'worker ', 1)} {how}, recovered from {source}"
    if change.get("cause") == "leave":
        return "preemption notice: workers handed over and left"
    if change.get("cause") == "coordinator":
        return "coordinator lost: its replacement took the workers over from their memory"
    if change["to"] > change["from"]:
        return "scale-up: workers joined at a safe point"
    return "scale-down at a safe point"


def _known(count: int | None) -> int | str:
    return "?" if count is None else count  # a restart from a checkpoint whose step no member logged


def demo_table(summary: dict, wall_s: float, png: str | None) -> str:
    """The demo's closing table, from the run's summary (pure)."""
    losses = summary.get("loss_curve") or []
    changes = sorted([("recovery", c) for c in summary["recoveries"]] +
                     [("reconfiguration", c) for c in summary["reconfigurations"]], key=lambda kc: kc[1]["failed_at"])
    first_loss = f"{losses[0][1]:.3f}" if losses else "-"
    last_loss = f"{losses[-1][1]:.3f}" if losses else "-"
    lines = [f"steps {summary['steps']}, loss {first_loss} -> {last_loss}, wall {wall_s:.1f} s, "
             f"first step after {summary['time_to_first_step_s']:.1f} s, samples "
             f"{summary['samples_consumed']} each once ({summary['duplicate_samples']} twice, "
             f"{summary['skipped_samples']} skipped)",
             f"  {'at step':>7}  {'event':<52}{'workers':>9}{'stall s':>9}  recomputed"]
    history = [n for _, n in summary["world_size_history"]]
    # every generation after the first began with one of these changes, in the same order
    by_order = len(history) == len(changes) + 1
    for i, (kind, c) in enumerate(changes):
        before = history[i] if by_order else c.get("from")
        after = history[i + 1] if by_order else c.get("to")
        workers = f"{before} -> {after}" if before is not None and after is not None else "-"
        recomputed = _known(c.get("recomputed_steps")) if kind == "recovery" else 0
        lost = f" ({_known(c.get('lost_steps'))} done steps lost)" if kind == "recovery" else ""
        # a change whose generation was lost whole has no measured stall (coordinator/books.py)
        stall = "-" if c.get("stall_s") is None else f"{c['stall_s']:.2f}"
        step = "-" if c.get("step") is None else c["step"]
        lines.append(f"  {step:>7}  {_what(c, kind):<52}{workers:>9}{stall:>9}  "
                     f"{recomputed} step(s){lost}")
    kills = [c for kind, c in changes if kind == "recovery" and c.get("to_next_step_done_s") is not None]
    if kills:
        ours = max(c["to_next_step_done_s"] for c in kills)
        lines.append(f"a kill cost {ours:.2f} s to the next completed step here; a restart from a checkpoint "
                     f"(Ray Train elastic, measured by `elastic-zero bench recovery`) costs {RAY_TRAIN_RECOVERY_S:.1f} s")
    if png:
        lines.append(f"plot: {png}")
    return "\n".join(lines)


def learned_lines(text: bytes, lines: int = 5, width: int = 100) -> list[str]:
    """The first `lines` lines of generated bytes as the console shows them (pure): decoded with
    replacement characters, control bytes but tabs shown as '?', each cut at `width`."""
    decoded = text.decode("utf-8", errors="replace").expandtabs(4)
    shown = ["".join(c if c.isprintable() else "?" for c in line)[:width] for line in decoded.split("\n")]
    return shown[:lines]


def sample_of(state_dict: dict) -> list[str]:
    """What the demo's GPT writes after PROMPT, from its final weights."""
    from elastic_zero.checkpoint import load_into
    from elastic_zero.models import build_preset
    from elastic_zero.models.generate import generate_bytes

    model = build_preset("gpt-tiny", **MODEL_KWARGS)
    load_into(model, state_dict)
    text = generate_bytes(model, PROMPT, NEW_BYTES, context=MODEL_KWARGS["seq_len"], temperature=TEMPERATURE)
    return learned_lines(text)


def run_demo(run_dir: str | None = None, progress: bool = True) -> int:
    from elastic_zero.api import RunConfig, run
    from elastic_zero.data.byte_corpus import write
    from elastic_zero.plot import plot_run

    config = RunConfig(run_dir=run_dir, progress=progress)
    path = config.path_for("demo")
    data_dir = os.path.join(path, "corpus")
    if not (os.path.isdir(data_dir) and os.listdir(data_dir)):
        try:
            write(data_dir, seq_len=128, max_mb=CORPUS_MB)
        except OSError as exc:  # the CLI's one line, exit 2
            raise ValueError(f"--run-dir {path}: cannot write the corpus there: {exc.strerror or exc}") from None
    spec = demo_spec(data_dir)
    print(f"elastic-zero demo: a byte-level GPT learns the Python standard library's source; 3 workers on a "
          f"local Ray; worker 1 is killed at step {KILL_STEP}, worker 0 gets a preemption notice at step "
          f"{PREEMPT_STEP}, the job is scaled to 4 at step {SCALE_STEP}; outputs in {path}", flush=True)
    started = time.time()
    result = run(spec, RunConfig(run_dir=path, progress=progress), started_at=started)
    wall = time.time() - started
    if not result.ok:
        print(f"elastic-zero: the demo failed: {result.error}", file=sys.stderr)
        return 1
    png, _ = plot_run(path)
    with open(os.path.join(path, "summary.json")) as fh:
        summary = json.load(fh)
    print(demo_table(summary, wall, png))
    print(f"what it learned: the GPT's own continuation of {PROMPT.decode()!r} (temperature {TEMPERATURE}), "
          f"from its final weights:")
    for line in sample_of(result.state_dict):
        print(f"  | {line}")
    return 0
