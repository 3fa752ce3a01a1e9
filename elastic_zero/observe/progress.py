"""The progress line of a job being driven (`run`, `logs --follow` shows what it printed).

On a terminal: a tqdm bar (step/total, loss, samples/s, world size, ETA) with one line per event
above it. Elsewhere (a file, a Ray job's log): the same event lines, and a plain progress line
every PLAIN_EVERY_S seconds. Only what a user acts on is an event line: evaluations, recoveries,
resizes, preemptions, checkpoints, the end; a worker killed by a drill is one such line, not Ray's
error text.
"""

from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 10.0


def describe(record: dict) -> str | None:
    """One line for an event the user should see, None for the others."""
    kind, r = record.get("event"), record
    if kind == "worker_lost" and r.get("during") == "ready":
        return f"worker {r['actor_id']} lost while it waited, ready, outside the generation ({r.get('error')})"
    if kind == "worker_lost":
        return f"worker {r['actor_id']} lost" + (f" (silent for {r['silent_s']:.1f} s)" if r.get("silent_s") else "")
    if kind == "generation_start":
        workers = len(r.get("workers", ()))
        if r.get("source") == "init" and r.get("resume"):
            return f"generation {r['generation']}: {workers} workers resume from the {r['resume']} checkpoint"
        if r.get("source") == "init":
            return f"generation {r['generation']}: training on {workers} workers"
        if r.get("source") == "snapshot":
            return f"recovery: generation {r['generation']} goes on from step {r['step']} on {workers} workers (from memory)"
        if r.get("source") == "checkpoint":
            return f"recovery: generation {r['generation']} restores {r.get('checkpoint')} on {workers} workers"
        if r.get("source") == "restart":
            return (f"recovery: generation {r['generation']} starts over from the initial weights on {workers} "
                    f"workers (nothing in memory or in a checkpoint held a trained step)")
        leaving = f", {', '.join(r['leaving'])} leaving" if r.get("leaving") else ""
        return f"resize: generation {r['generation']} has {workers} workers at step {r['step']}{leaving}"
    if kind == "worker_start_failed":
        return f"worker {r['actor_id']} could not start: {r['error']}"
    if kind == "preemption_notice":
        deadline = f" (deadline {r['deadline_s']:g} s)" if r.get("deadline_s") is not None else ""
        source = f" from {r['source']}" if r.get("source") not in (None, "drill") else ""
        if r.get("node"):  # a node's notice: every worker of the job there leaves
            return (f"preemption notice{source} for node {r['node'][:12]}{deadline}: "
                    f"{', '.join(r['actor_ids']) or 'no worker of this job'} to leave at a safe point")
        return f"preemption notice{source} for {r['actor_id']}{deadline}"
    if kind == "notice_checkpoint":
        return (f"no worker can take the shards of {', '.join(r['actor_ids'])} before they go: a checkpoint of the "
                f"next step is saved now, and they train on until replacements join or they go")
    if kind == "watcher":
        if not r.get("problem", True):
            return None
        return f"preemption watcher{' on node ' + r['node'][:12] if r.get('node') else ''}: {r['message']}"
    if kind == "scale_requested":
        return f"scale to {r['workers']} workers requested"
    if kind == "stop_requested":
        return "stop requested" + (" with a final checkpoint" if r.get("checkpoint") else "")
    if kind == "checkpoint_committed":
        return f"checkpoint committed: {r['directory']}"
    if kind == "checkpoint_failed":
        return f"checkpoint failed: {r['error']}"
    if kind == "checkpoint_restored":
        return f"restored {r['directory']}"
    if kind == "coordinator_restarted":
        return f"the coordinator was restarted ({r['restarts']}); resuming from the {r.get('resume') or 'start'}"
    if kind == "generation_taken_over":
        return f"the new coordinator took over generation {r['generation']} from its {len(r['workers'])} workers"
    if kind == "warning":
        return f"warning: {r['message']}"
    if kind == "job_failed":
        return f"job failed: {r['message']}"
    if kind == "eval":
        perplexity = f", perplexity {r['perplexity']:.2f}" if r.get("perplexity") is not None else ""
        metrics = "".join(f", {name} {value:.4g}" for name, value in (r.get("metrics") or {}).items())
        return f"eval at step {r['step']}: loss {r['loss']:.4f}{perplexity}{metrics} ({r['samples']} samples)"
    if kind == "job_stopped":
        return f"stopped at step {r['step']}"
    return None


def progress_text(p: dict) -> str:
    loss = f"loss {p['loss']:.4f}" if p.get("loss") is not None else "loss -"
    if p.get("eval_loss") is not None:
        loss += f"  eval {p['eval_loss']:.4f}"
    rate = f"{p['samples_per_s']:.1f} samples/s" if p.get("samples_per_s") else "- samples/s"
    eta = f"ETA {hms(p['eta_s'])}" if p.get("eta_s") is not None else "ETA -"
    return f"step {p['step']}/{p['steps']}  {loss}  {rate}  world {p['world_size']}  {eta}"


def hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


class ProgressView:
    def __init__(self, stream=None, tty: bool | None = None, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self._bar = None
        self._plain_at = None
        self._plain_step = None
        self._last_event = ""

    def event(self, record: dict) -> None:
        line = describe(record)
        if line is None:
            return
        self._last_event = line
        stamp = time.strftime("%H:%M:%S", time.localtime(record.get("t", time.time())))
        if self._bar is not None:
            self._bar.write(f"{stamp} {line}", file=self.stream)
        else:
            print(f"{stamp} {line}", file=self.stream, flush=True)

    def update(self, p: dict) -> None:
        if not p["world_size"] or p.get("loss") is None:  # no step done yet: nothing to show but dashes
            return
        if self.tty:
            self._draw_bar(p)
            return
        now = self.clock()
        last = p["step"] >= p["steps"] and self._plain_step != p["step"]
        if self._plain_at is None or now - self._plain_at >= PLAIN_EVERY_S or last:
            self._plain_at, self._plain_step = now, p["step"]
            print(f"{time.strftime('%H:%M:%S')} {progress_text(p)}", file=self.stream, flush=True)

    def _draw_bar(self, p: dict) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=p["steps"], unit="step", file=self.stream, dynamic_ncols=True,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")
        self._bar.n = p["step"]
        loss = f"{p['loss']:.4f}" if p.get("loss") is not None else "-"
        if p.get("eval_loss") is not None:
            loss += f", eval {p['eval_loss']:.4f}"
        rate = f"{p['samples_per_s']:.1f}" if p.get("samples_per_s") else "-"
        eta = hms(p["eta_s"]) if p.get("eta_s") is not None else "-"
        last = f" | {self._last_event[:50]}" if self._last_event else ""
        self._bar.set_postfix_str(f"loss {loss}, {rate} samples/s, world {p['world_size']}, ETA {eta}{last}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
