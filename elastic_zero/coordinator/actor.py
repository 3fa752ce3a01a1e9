"""The coordinator actor: hosts the rendezvous store, spawns workers, starts generations.

It feeds events (workers ready, generations ended, scale and stop requests, preemption notices,
ticks) to the pure state machine and carries out the commands it returns. It is the only owner of
membership. Workers never wait on it on the training path: they report when a generation ends,
and rank 0 sends fire-and-forget notes of its progress.

Its loop runs on a thread of its own from the start, so the job goes on whoever waits for it (or
nobody: on a cluster it is a detached actor, and its driver may die). Its driver starts it again if
its process dies (driver.py says why not Ray); the new one resumes from the latest checkpoint (its
workers died with it). What the outside sees of it (status, progress, stop) is in face.py; its side
of nodes that go (notices, silence) in node_watch.py; spawning and retiring workers in spawner.py;
the final weights (a checkpoint the workers write) and a stop's in final_save.py.

It imports no torch: its rendezvous store is served by its relay's process in Python, with torch's
protocol (rendezvous.py, store_server.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import traceback

import ray

from elastic_zero.coordinator.books import Books, steps_reached
from elastic_zero.coordinator.completions import Completions
from elastic_zero.coordinator.events import GenerationStepped, NodeNotice
from elastic_zero.coordinator.face import CoordinatorFace
from elastic_zero.coordinator.death_causes import is_memory_kill, memory_kill
from elastic_zero.coordinator.final_save import FinalSave
from elastic_zero.coordinator.memory_watch import MemoryWatch
from elastic_zero.coordinator.resume import resume_point
from elastic_zero.coordinator.node_watch import STUCK_POLL_S, NodeWatch
from elastic_zero.coordinator.spawner import WorkerSpawner
from elastic_zero.coordinator.state import (
    CheckpointNow, CoordinatorState, Fail, Finish, GenerationEnded, MemorySeen, RequestSafePoint, Retire, Spawn, Start,
    StartGeneration, Stop, Tick, Warn, decide,
)
from elastic_zero.wire.generation_ends import announce_end
from elastic_zero.observe.event_log import EventLog
from elastic_zero.observe.live import LiveProgress
from elastic_zero.observe.metrics import JobMetrics
from elastic_zero.observe.tracking import start_tracking
from elastic_zero.protocol import Outcome, OutcomeKind, Report, Source, pack_plan
from elastic_zero.wire.rendezvous import RendezvousServer, new_secret
from elastic_zero.job.spec import KILL_ACTIONS, spec_from_dict

NAMESPACE = "elastic_zero"
LINGER_S = 120.0  # a finished coordinator nobody collected from goes after this long (ELASTIC_ZERO_LINGER_S)


def coordinator_name(job: str) -> str:
    return f"elastic-zero:{job}"


class Coordinator(CoordinatorFace, NodeWatch, WorkerSpawner, FinalSave):
    def __init__(self, spec: dict, job_id: str, run_dir: str, started_at: float, restarted: bool = False,
                 workforce=None) -> None:
        """`restarted`: a driver started it again after the job's coordinator died. `workforce`: where
        its workers come from (workforce.py; None: a Ray actor each)."""
        self.job_id, self.run_dir, self.started_at = job_id, run_dir, started_at
        self.restarted = restarted  # never Ray (max_restarts=0, driver.py): only its driver starts it again
        self.spec = spec_from_dict(spec)
        if self.restarted and self.spec.checkpoint.uri and self.spec.checkpoint.every:
            # its workers died with the previous one: the latest checkpoint (none yet: a fresh start)
            spec = {**spec, "checkpoint": {**spec["checkpoint"], "resume": "latest"}}
            self.spec = spec_from_dict(spec)
        self.spec_dict = spec
        e = self.spec.elastic
        self.host = ray.util.get_node_ip_address()
        # the job's store, in a relay process that admits only holders of its secret (wire/rendezvous.py)
        self._secret = new_secret()
        self.rendezvous = RendezvousServer(self.host, self._secret, e.collective_timeout_s)
        self.state = CoordinatorState(min_workers=e.min_workers, max_workers=e.max_workers, target=e.workers,
                                      min_wait_s=e.min_wait_s, join_window_s=e.join_window_s,
                                      replicated=e.replicate_every != 0, standby=e.standby_workers)
        self.books = Books(self.spec.train.global_batch, self.spec.train.steps, started_at)
        self.events = EventLog(run_dir, go_on=self.restarted)
        self.live = LiveProgress(self.spec.train.global_batch, self.spec.train.steps)
        per_node = e.memory_per_node_gib
        self.memory = MemoryWatch(int(per_node * 2**30) if per_node else None)  # what the workers measured
        self.metrics = JobMetrics(job_id)
        self.tracking = start_tracking(self.spec, spec, job_id, run_dir, self._warn, self.restarted)
        if self.tracking is not None:
            self.events.listener = self.tracking.event
        self.restarts = self.events.count("coordinator_restarted") + (1 if self.restarted else 0)
        self._commits_told = {r["directory"] for r in self.events.records if r.get("event") == "checkpoint_committed"}
        self._restores_told: set = set()
        numbers = [r["generation"] for r in self.events.records if r.get("event") == "generation_start"]
        self.state = dataclasses.replace(self.state, first_generation=max(numbers) + 1 if numbers else 0)
        self._done = threading.Event()
        self._collected = threading.Event()  # the driver took the result
        self._inbox: queue.Queue = queue.Queue()
        self.completions = Completions()  # hellos and train calls in flight, collected as they complete
        self._lock = threading.Lock()
        self._coordinator_name, self._namespace = coordinator_name(job_id), NAMESPACE
        self._train_refs: dict = {}
        self._results: dict[str, Report] = {}
        self._plan = self._last_plan = None
        self._result: dict | None = None
        self._last_end: dict[str, Report] = {}
        self._timed_faults: set[str] = set()
        self._candidate_logs: list = []  # (directory, sample records) of a checkpoint generation's candidates
        self._failure_seen_at: float | None = None  # a participant of the current generation failed
        self._start_spawner(workforce)
        self._start_node_watch()
        threading.Thread(target=self._main, daemon=True, name="coordinator-loop").start()

    # ---- the main loop -------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._drive()
        except Exception as exc:  # noqa: BLE001 - a bug here must end the job with its reason, not hang it
            traceback.print_exc()  # where: into the coordinator's log
            message = f"the coordinator failed: {type(exc).__name__}: {exc}"[:400]
            self._log("job_failed", message=message)
            self._result = self._result or {"ok": False, "error": message, "summary": self.books.summary(None)}
        finally:
            self._drain_stop.set()
            self._retire(tuple(self._workers), "the job is over")  # spawned ones that never joined too
            self._result = self._result or {"ok": False, "error": "the coordinator ended without a result", "summary": {}}
            try:
                self._write_summary()
                self._publish_final_status()
            finally:
                self._done.set()
        # nobody may be left to collect the result (a cluster): go after a while, by its own handle (no restart)
        if not self._collected.wait(float(os.environ.get("ELASTIC_ZERO_LINGER_S", LINGER_S))):
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _drive(self) -> None:
        if self.restarted:
            final = self._final_status()
            if final is not None:  # it died while lingering: the job is over, and stays so
                self._log("coordinator_restarted", restarts=self.restarts, resume=None)
                path = os.path.join(self.run_dir, "summary.json")
                summary = json.load(open(path)) if os.path.exists(path) else {}
                ended = next((e for e in reversed(self.events.records) if e.get("event") in ("job_finished", "job_stopped")), {})
                self._result = {"ok": final["state"] != "failed", "error": final["error"], "summary": summary,
                                "final_checkpoint": ended.get("final_checkpoint")}
                return
            c = self.spec.checkpoint
            self._log("coordinator_restarted", restarts=self.restarts,
                      resume="latest checkpoint" if c.uri and c.every else None)
            if not (c.uri and c.every):
                self._carry_out(Fail("the coordinator was lost (its workers with it) and the job saves no "
                                     "checkpoints to resume from"))
                return
        self._log("job_start", name=self.spec.name, workers=self.spec.elastic.workers, job_id=self.job_id)
        c = self.spec.checkpoint
        if c.uri:  # where the job runs (the CLI checked where it was launched); every job writes its final weights
            from elastic_zero.checkpoint import probe_writable

            try:
                probe_writable(c.uri)
                resumed = resume_point(c.uri, c.resume)
            except ValueError as exc:
                self._carry_out(Fail(str(exc)))
                return
            if resumed is not None and resumed[0] >= self.spec.train.steps:
                self._finish_at_resume(*resumed)
                return
            # the checkpoint resumed is one to fall back to; without one, what memory cannot restore starts over
            self.state = dataclasses.replace(self.state, committed=resumed is not None)
        self._apply(Start())
        last_tick = next_listen = next_stuck_look = time.monotonic()
        while self._result is None:
            while not self._inbox.empty():
                item = self._inbox.get_nowait()
                if isinstance(item, NodeNotice):
                    self._on_node_notice(item)
                elif callable(item):  # a note to take on this thread (face.py)
                    item()
                else:
                    self._apply(item)
            for ref in self.completions.completed(max(0.0, min(0.05, next_listen - time.monotonic()))):
                self._collect(ref)
                if time.monotonic() >= next_listen:  # a thousand reports take a while: silence is not put off
                    next_listen = self._notice_silent_workers()
            self._kill_unresponsive()
            if time.monotonic() >= next_stuck_look:
                next_stuck_look = time.monotonic() + STUCK_POLL_S
                self._notice_stuck_workers()
            if time.monotonic() >= next_listen:
                next_listen = self._notice_silent_workers()
            if self._plan is not None and not self._train_refs:
                self._end_generation()
            if time.monotonic() - last_tick > 0.5:
                last_tick = time.monotonic()
                self._refresh_memory()
                self._notice_unplaceable_workers()
                self._apply(Tick())

    def _collect(self, ref) -> None:
        if ref not in self._ready_refs and ref not in self._train_refs:
            return  # given up on already (its worker was silent)
        if ref in self._ready_refs:
            self._hello_arrived(ref)
            return
        actor_id = self._train_refs.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the actor died
            oom = memory_kill(str(exc))
            result = Report(Outcome(actor_id, OutcomeKind.DEAD, error=oom or str(exc)[:300]), ended_at=time.time())
            self._log("worker_lost", actor_id=actor_id, **({"cause": oom} if oom else {}))
        self._results[actor_id] = result
        if result.outcome.kind in (OutcomeKind.DEAD, OutcomeKind.FAILED):
            self._generation_failed()
        if result.outcome.kind == OutcomeKind.LEFT:
            self._retire((actor_id,), "left after handing its shard over")

    def _generation_failed(self) -> None:
        """A participant died or its collective failed: the generation is over. Abort the others now,
        so that they don't find out one collective (or one timeout) at a time: one store key they
        all wait for (generation_ends.py); once, as every survivor's report of the failure comes here too."""
        if self._failure_seen_at is not None:
            return
        self._failure_seen_at = time.monotonic()
        announce_end(self.rendezvous.store, self._plan.number, aborted=True)

    def _ask_one_member(self, method: str) -> None:
        """A safe point or a checkpoint is asked of one member still training: each rank adds its request into
        the step's closing all-reduce (worker/trainer.py), so all act at one step (asking 1,024 took 1.4 s)."""
        gen, running = self.state.generation, set(self._train_refs.values())  # (one found lost is retired at once)
        asked = next((m.actor_id for m in gen.members if m.actor_id in running and m.actor_id in self._workers), None)
        if asked is not None:  # none: the generation is ending, and the next one is planned with what was asked
            getattr(self._workers[asked], method).remote(gen.number)

    def _kill_unresponsive(self) -> None:
        """A participant still silent a collective timeout after the generation failed is hung (alive
        but not answering): kill it, so that it counts as lost and the survivors can recover."""
        if self._failure_seen_at is None or not self._train_refs:
            return
        if time.monotonic() - self._failure_seen_at < self.spec.elastic.collective_timeout_s:
            return
        for actor_id in list(self._train_refs.values()):
            self._log("worker_unresponsive", actor_id=actor_id)
            handle = self._workers.get(actor_id)
            if handle is not None:
                self.workforce.kill(handle)
        self._failure_seen_at = time.monotonic()  # their deaths arrive as their calls complete

    def _end_generation(self) -> None:
        plan, results = self._plan, self._results
        self._plan, self._results = None, {}
        announce_end(self.rendezvous.store, plan.number, aborted=False)  # (an abort, said first, stays)
        members = {m.actor_id for m in plan.generation.members}
        restored = {r.restored_from for r in results.values() if r.restored_from}
        for directory in restored:
            self._checkpoint_restored(plan.number, directory)
            if plan.source == Source.CHECKPOINT:
                self._add_checkpoint_logs(directory)
        for r in results.values():
            for directory in r.checkpoints:
                self._checkpoint_committed(directory, plan.number)
            for error in r.checkpoint_errors:
                self._log("checkpoint_failed", generation=plan.number, actor_id=r.outcome.actor_id, error=error)
        # every rank skipped the same saves: any report that lived says which
        self._saves_skipped(plan.number, next((r.checkpoints_skipped for r in results.values() if r.checkpoints_skipped), ()))
        changes_before = len(self.books.recoveries), len(self.books.reconfigurations)
        self.books.add_generation_results(plan.number, [r for a, r in results.items() if a in members])
        self._count_metrics(results.values(), changes_before)
        # the leavers' outcomes too: after a failed handover they still hold shards of the previous layout
        outcomes = tuple(r.outcome for r in results.values() if r.outcome.kind != OutcomeKind.DEAD)
        alive = sum(1 for o in outcomes if o.actor_id in members)
        kinds = sorted({o.kind for o in outcomes if o.actor_id in members} | ({OutcomeKind.DEAD} if alive < len(members) else set()))
        self._log("generation_end", generation=plan.number, outcomes=kinds,
                  ended_at={a: round(r.ended_at, 4) for a, r in results.items()},
                  errors={o.actor_id: o.error for o in outcomes if o.error},
                  **_last_step(results.values()))
        self._last_end = results
        if alive < len(members) or any(o.kind == OutcomeKind.FAILED for o in outcomes):
            self._find_own_commits()  # a commit whose note was lost with rank 0 is restored, not started over
        if any(r.outcome.kind == OutcomeKind.DEAD and is_memory_kill(r.outcome.error) for r in results.values()):
            self._memory_killed(plan)  # before the recovery is planned: not into the same death
        self._apply(GenerationEnded(outcomes))

    # ---- carrying out decisions ------------------------------------------------------------------

    def _apply(self, event) -> None:
        with self._lock:
            self.state, commands, reason = decide(self.state, event, time.monotonic())
        if not isinstance(event, (Tick, MemorySeen)) or commands:
            self._log("decision", on=type(event).__name__, reason=reason)
        if isinstance(event, GenerationStepped):  # kept for a change whose generation may yet be lost whole
            self.books.generation_stepped(event.number, event.at)
        for command in commands:
            self._carry_out(command)

    def _carry_out(self, command) -> None:
        if isinstance(command, Spawn):
            self._spawn(command.count)
        elif isinstance(command, CheckpointNow):
            self._checkpoint_before_leaving()
        elif isinstance(command, RequestSafePoint):
            self._ask_one_member("request_safe_point")
        elif isinstance(command, StartGeneration):
            plan = command.plan
            if plan.source == Source.CHECKPOINT:
                try:
                    plan = dataclasses.replace(plan, checkpoints=self._checkpoint_candidates())
                except ValueError as exc:
                    self._carry_out(Fail(f"no in-memory copy survived and no checkpoint can be read: {exc}"))
                    return
            self._start(plan)
        elif isinstance(command, Retire):
            self._retire(command.actor_ids, "retired")
        elif isinstance(command, Finish):
            self._finish()
        elif isinstance(command, Stop):
            self._stop(command)
        elif isinstance(command, Warn):
            self._warn(command.message)
        elif isinstance(command, Fail):
            self._log("job_failed", message=command.message)
            self._retire(tuple(self._workers), "job failed")
            self._result = {"ok": False, "error": command.message, "summary": self.books.summary(None),
                            "bad_input": command.bad_input}

    def _start(self, plan) -> None:
        now = time.time()
        last = self._last_end
        if plan.source in (Source.SNAPSHOT, Source.CHECKPOINT, Source.RESTART):
            failed_at = min(self._new_kill_times() + [r.ended_at for r in last.values()] or [now])
            reached = steps_reached(last.values(), self._last_words(self._last_plan.number))
            lost = sorted(a + (f" ({r.outcome.error})" if is_memory_kill(r.outcome.error) else "")
                          for a, r in last.items() if r.outcome.kind == OutcomeKind.DEAD)
            cause = f"lost {', '.join(lost)}" + ("; restored from a checkpoint" if plan.checkpoints else "") + \
                ("; started over from the initial weights" if plan.source == Source.RESTART else "")
            self.books.begin_change("recovery", failed_at, plan.number, step=plan.step if plan.step >= 0 else None,
                                    cause=cause, reached=reached, source=plan.source)
        elif plan.source == Source.LIVE:
            since = max((r.ended_at for r in last.values()), default=now)
            self.books.begin_change("reconfiguration", since, plan.number, step=plan.step, **{
                "from": plan.previous.world_size, "to": plan.generation.world_size}, cause=plan.cause)
        self.books.world_size_history.append([plan.step, plan.generation.world_size])
        resume = {"resume": self.spec.checkpoint.resume} if plan.source == Source.INIT and self.spec.checkpoint.resume else {}
        self._log("generation_start", generation=plan.number, step=plan.step, source=plan.source, **resume,
                  checkpoint=plan.checkpoints[0] if plan.checkpoints else None,
                  workers=[m.actor_id for m in plan.generation.members], leaving=list(plan.leaving))
        self._plan = self._last_plan = plan
        if plan.source != Source.INIT:  # counted as they start, as status counts them
            self.metrics.add("elastic_zero_reconfigurations" if plan.source == Source.LIVE else "elastic_zero_recoveries")
        self._failure_seen_at = None
        self._listen_to(plan.participants)
        shared = pack_plan(plan)  # serialized once: pickling a plan of N members for each of N calls is O(N^2)
        for actor_id in plan.participants:
            ref = self._workers[actor_id].train.remote(shared)
            self._train_refs[ref] = actor_id
            self.completions.watch(ref)

    def _checkpoint_candidates(self) -> tuple[str, ...]:
        """What a checkpoint generation may restore: the committed checkpoints, newest commit first.
        Their sample records are read now: pruning may remove them while the generation trains."""
        from elastic_zero.checkpoint import open_store, read_manifest, restore_candidates
        from elastic_zero.checkpoint.sample_runs import manifest_rows

        fs, root = open_store(self.spec.checkpoint.uri)
        candidates = tuple(restore_candidates(fs, root))
        if not candidates:
            raise ValueError(f"{root}: no committed checkpoint")
        self._candidate_logs = [(d, manifest_rows(read_manifest(fs, d).extra)) for d in reversed(candidates)]
        return candidates

    def _add_checkpoint_logs(self, restored: str) -> None:
        """The sample records of the restored checkpoint and older commits, for reports that were lost."""
        for directory, rows in self._candidate_logs:  # oldest commit first
            self.books.add_checkpoint_log(rows)
            if directory == restored:
                break

    def _new_kill_times(self) -> list[float]:
        """When the kill drills that fired since the last recovery killed their workers."""
        times = []
        store = self.rendezvous.store
        for i, fault in enumerate(self.spec.faults):
            key = f"fault/{i}/at"
            if fault.action in KILL_ACTIONS and key not in self._timed_faults and store.check([key]):
                self._timed_faults.add(key)
                times.append(float(store.get(key).decode()))
        return times

    def _log(self, kind: str, **fields) -> None:
        self.events.add(kind, **fields)


def _last_step(reports) -> dict:
    """The loss and metrics of a generation's last step, as rank 0 saw them (every rank sees the same)."""
    for r in reports:
        if r.rank == 0 and r.last_loss is not None:
            return {"steps_done": r.outcome.step, "loss": r.last_loss, "metrics": dict(r.last_metrics)}
    return {}
