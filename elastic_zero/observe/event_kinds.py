"""The kinds of record in a job's event log (RUN_DIR/events.jsonl), declared once: each kind's name,
the fields its records may carry beside "t" (when, epoch seconds) and "event" (the kind), and what it
says. The coordinator writes them (EventLog.add refuses a kind or a field not declared here); the
status, the summary, the progress line, the plot, the trackers and the benchmarks read them
(tests/test_event_kinds.py holds every name they compare against to this table).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventKind:
    name: str
    fields: frozenset[str]
    about: str


def _kind(name: str, fields: str, about: str) -> EventKind:
    return EventKind(name, frozenset(fields.split()), about)


KINDS: dict[str, EventKind] = {k.name: k for k in (
    # the job
    _kind("job_start", "name workers job_id", "the coordinator began the job"),
    _kind("coordinator_restarted", "restarts resume", "a coordinator took over from one that died"),
    _kind("job_finished", "steps final_checkpoint note", "every step done; its final weights' checkpoint"),
    _kind("job_stopped", "step checkpoint final_checkpoint", "stopped on request at a safe point"),
    _kind("job_failed", "message", "the job failed: why, in one line"),
    _kind("scale_requested", "workers", "a user asked for this many workers"),
    _kind("stop_requested", "checkpoint", "a user asked the job to stop (with a final checkpoint or not)"),
    _kind("decision", "on reason listener_behind_s",
          "the state machine decided something: on what input, and why (a Silence: how far behind the "
          "heartbeat listener was)"),
    _kind("warning", "message actor_id", "something the job could not do as asked, told once"),
    # generations
    _kind("generation_start", "generation step source checkpoint workers leaving resume calls",
          "a generation began: from which state (init, live, snapshot, checkpoint, restart), with whom, and "
          "how many train calls it took (the other participants' calls stood: wire/standing_calls.py)"),
    _kind("change_begun", "generation pending",
          "a recovery or reconfiguration began with this generation: what a replacement coordinator measures it from"),
    _kind("change_measured", "what change",
          "a recovery or reconfiguration as the summary has it, once measured: a replacement "
          "coordinator's summary counts it too"),
    _kind("generation_taken_over", "generation step workers",
          "a coordinator that replaced a lost one took over the generation it had started, from its workers"),
    _kind("generation_end", "generation outcomes ended_at errors steps_done loss metrics samples",
          "a generation ended: each participant's outcome, the last step's loss, and the sample records its "
          "reports gave, as runs (checkpoint/sample_runs.py), from which a replacement coordinator's books begin"),
    _kind("replicas_cadence", "generation every auto cost reason", "the replica cadence a generation agreed on"),
    _kind("eval", "generation step loss metrics samples perplexity seconds", "an evaluation of the weights"),
    # workers
    _kind("spawn", "count actor_ids asked_t", "workers asked of Ray"),
    _kind("worker_ready", "actor_id node pid node_up_t start_s",
          "a worker said hello: where it runs, and its start by phase (worker/start_clock.py)"),
    _kind("worker_start_failed", "actor_id error", "a worker could not start"),
    _kind("worker_lost", "actor_id error during silent_s cause", "a worker died, went silent or was found stuck"),
    _kind("worker_stuck", "actor_id still_s where", "a live worker stood still behind its peers: killed"),
    _kind("worker_unresponsive", "actor_id", "a worker that did not answer was killed"),
    _kind("retire", "actor_ids why", "workers ended by the coordinator"),
    # nodes and notices
    _kind("preemption_notice", "actor_id actor_ids node source deadline_s detail", "a worker or node will go"),
    _kind("notice_acknowledged", "node ack", "a cloud's notice was acknowledged"),
    _kind("notice_checkpoint", "generation actor_ids", "a checkpoint asked for before a notice's deadline"),
    _kind("watcher", "node problem message", "a preemption watcher could not watch"),
    # checkpoints
    _kind("checkpoint_committed", "generation directory", "a checkpoint committed (rank 0's commit)"),
    _kind("checkpoint_failed", "generation actor_id error", "a checkpoint could not be written"),
    _kind("checkpoint_skipped", "generation step", "a periodic checkpoint skipped (the previous one still writing)"),
    _kind("checkpoint_restored", "generation step directory", "a generation restored this checkpoint"),
    _kind("checkpoint_samples", "generation directory samples",
          "the sample records (runs) a restore booked from its checkpoint and older commits, of steps whose "
          "own reports were lost: a coordinator that takes over books them again, as the store may have "
          "pruned those checkpoints by then"),
)}


def check(kind: str, fields) -> None:
    """ValueError (a bug in the writer) for a kind or a field this table does not declare."""
    declared = KINDS.get(kind)
    if declared is None:
        raise ValueError(f"event kind {kind!r} is not declared in observe/event_kinds.py")
    unknown = set(fields) - declared.fields
    if unknown:
        raise ValueError(f"event {kind!r}: field(s) {sorted(unknown)} not declared in observe/event_kinds.py")
