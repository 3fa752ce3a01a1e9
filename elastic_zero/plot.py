"""`elastic-zero plot RUN_DIR`: what a run did, at a glance, from its summary.json and events.jsonl.

Three panels over the steps: the loss (and, with [eval], the eval loss as a second line), the
samples/s of each step, and the world size as a step line. Every recovery, scale, preemption and checkpoint is a vertical line across them, labelled
on the top panel. read_run() gathers the series (pure: files in, data out); plot_run() draws them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

_STEP_DIR = re.compile(r"step-(\d{10})(?:-\d+)?$")
_COLOURS = {"recovery": "tab:red", "scale": "tab:green", "preemption": "tab:orange", "takeover": "tab:brown",
            "checkpoint": "0.6"}
SIZE_PX = (1000, 750)
_DPI = 100


@dataclass(frozen=True)
class Mark:
    step: int
    kind: str  # "recovery" | "scale" | "preemption" | "takeover" | "checkpoint"
    label: str


@dataclass(frozen=True)
class RunSeries:
    name: str
    loss: tuple  # (step, loss)
    eval_loss: tuple  # (step, eval loss): the weights after that step on the eval set
    samples_per_s: tuple  # (step, global batch / the step's time)
    world_size: tuple  # (step, size) from each generation's first step
    marks: tuple  # Mark, in step order
    last_step: int


def read_run(run_dir: str) -> RunSeries:
    """The series of a finished run's directory; ValueError naming the file if one is missing."""
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    events_path = os.path.join(run_dir, "events.jsonl")
    try:
        with open(events_path) as fh:
            events = [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"{events_path}: no such file (is {run_dir!r} a run directory?)") from None
    batch = summary.get("global_batch") or 0
    loss = tuple((int(s), float(v)) for s, v in summary.get("loss_curve", []))
    eval_loss = tuple((int(s), float(v)) for s, v in summary.get("eval_curve", []))
    rates = tuple((int(s), batch / t) for s, t in summary.get("step_time_curve", []) if t > 0)
    marks = [Mark(r["step"], "recovery", f"{r.get('cause', 'failure')}: {_stall(r)}")
             for r in summary.get("recoveries", []) if r.get("step") is not None]
    for r in summary.get("reconfigurations", []):
        # workers leave on a preemption notice; a lost coordinator's replacement takes them over
        kind = {"leave": "preemption", "coordinator": "takeover"}.get(r.get("cause"), "scale")
        marks.append(Mark(r["step"], kind, f"{r.get('from')}->{r.get('to')} workers: {_stall(r)}"))
    for e in events:
        found = _STEP_DIR.search(str(e.get("directory", ""))) if e.get("event") == "checkpoint_committed" else None
        if found:
            marks.append(Mark(int(found.group(1)), "checkpoint", "checkpoint"))
    start = summary.get("name") or os.path.basename(os.path.normpath(run_dir))
    name = next((e.get("name") for e in events if e.get("event") == "job_start"), start)
    last = max([s for s, _ in loss] + [int(summary.get("steps") or 0)])
    return RunSeries(name, loss, eval_loss, rates, tuple((int(s), int(n)) for s, n in summary.get("world_size_history", [])),
                     tuple(sorted(marks, key=lambda m: (m.step, m.kind))), last)


def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (is the directory a run directory?)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def plot_run(run_dir: str, out: str | None = None) -> tuple[str, RunSeries]:
    """Draw the run into a PNG (default RUN_DIR/run.png) of SIZE_PX pixels; (its path, the series)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
    import matplotlib.pyplot as plt

    series = read_run(run_dir)
    out = out or os.path.join(run_dir, "run.png")
    fig, (ax_loss, ax_rate, ax_world) = plt.subplots(
        3, 1, sharex=True, figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI,
        gridspec_kw={"height_ratios": [3, 2, 1.2]})
    if series.loss:
        ax_loss.plot(*zip(*series.loss), color="tab:blue", linewidth=1.2, label="train")
    if series.eval_loss:
        ax_loss.plot(*zip(*series.eval_loss), color="tab:brown", linewidth=1.2, marker="o", markersize=3,
                     label="eval")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{series.name}: {series.last_step} steps", loc="left")
    if series.samples_per_s:
        ax_rate.plot(*zip(*series.samples_per_s), color="tab:purple", linewidth=0.8)
    ax_rate.set_ylabel("samples/s")
    if series.world_size:
        steps, sizes = zip(*series.world_size)
        ax_world.step([*steps, series.last_step], [*sizes, sizes[-1]], where="post", color="black")
        ax_world.set_ylim(0, max(sizes) + 1)
        ax_world.set_yticks(range(0, max(sizes) + 1))
    ax_world.set_ylabel("workers")
    ax_world.set_xlabel("step")
    ax_world.set_xlim(0, max(series.last_step, 1))
    labelled = set()
    for i, mark in enumerate(series.marks):
        colour = _COLOURS[mark.kind]
        style = ":" if mark.kind == "checkpoint" else "--"
        for ax in (ax_loss, ax_rate, ax_world):
            ax.axvline(mark.step, color=colour, linestyle=style, linewidth=1)
        if mark.kind != "checkpoint":  # checkpoints are many: the legend names them once
            ax_loss.annotate(mark.label, (mark.step, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(3, -12 - 11 * (i % 4)), textcoords="offset points", fontsize=8, color=colour)
        if mark.kind not in labelled:
            ax_loss.plot([], [], color=colour, linestyle=style, label=mark.kind)
            labelled.add(mark.kind)
    if labelled or series.eval_loss:
        ax_loss.legend(loc="upper right", fontsize=8)
    for ax in (ax_loss, ax_rate, ax_world):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=_DPI)
    plt.close(fig)
    return out, series


def _stall(change: dict) -> str:
    """A change whose generation was lost whole has no measured stall (coordinator/books.py)."""
    return "stall unknown" if change.get("stall_s") is None else f"stall {change['stall_s']:.2f} s"
