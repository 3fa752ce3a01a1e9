"""The coordinator's loop: it feeds events (workers ready, generations ended, scale and stop requests, preemption
notices, silences, ticks) to the pure state machine (state.py) and carries out the commands it returns, through
the parts that own what they act on: the worker pool (worker_pool.py), the generations (generations.py), the
node watch (node_watch.py: notices, heartbeats, silent and stuck workers), the final save (final_save.py), the
job's record (job_record.py: events, books, live figures, metrics) and the memory watch (memory_watch.py).

Only this loop changes membership; the actor's other threads (Ray's calls, actor.py) put what they
are told into its inbox.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback

import ray

from elastic_zero.coordinator.completions import Completions
from elastic_zero.coordinator.death_causes import is_memory_kill
from elastic_zero.coordinator.events import (CheckpointCommitted, GenerationStepped, NodeNotice, PreemptionNotice,
                                             WorkersReady, WorkerStartFailed)
from elastic_zero.coordinator.final_save import Ended, FinalSave, LostInSave, SaveFailed
from elastic_zero.coordinator.generations import Generations
from elastic_zero.coordinator.job_record import JobRecord
from elastic_zero.coordinator.memory_watch import MemoryWatch
from elastic_zero.coordinator.node_watch import STUCK_POLL_S, NodeWatch
from elastic_zero.coordinator.commit_reads import commits_since
from elastic_zero.coordinator.resume import result_of_ended_job, writable_resume_point
from elastic_zero.coordinator.worker_pool import WorkerPool
from elastic_zero.coordinator.workforce import RayWorkforce
from elastic_zero.coordinator.takeover import carried_over, find_generation, spawned_ids, take_over
from elastic_zero.coordinator.transitions import taken_over
from elastic_zero.coordinator.state import (CheckpointNow, CoordinatorState, Fail, FinalWeightsWritten, Finish,
                                            GenerationEnded, MemorySeen, RequestSafePoint, Retire, Spawn, Start,
                                            StartGeneration, Stop, Tick, Warn, decide)
from elastic_zero.job.spec import spec_from_dict
from elastic_zero.protocol import OutcomeKind
from elastic_zero.wire.rendezvous import RendezvousServer, new_secret


class JobLoop:
    def __init__(self, spec: dict, job_id: str, run_dir: str, started_at: float, restarted: bool, workforce,
                 coordinator_name: str, namespace: str) -> None:
        """`restarted`: a driver started the coordinator again after the job's coordinator died.
        `workforce`: where its workers come from (workforce.py; None: a Ray actor each)."""
        self.job_id, self.run_dir, self.started_at, self.restarted = job_id, run_dir, started_at, restarted
        self.spec = spec_from_dict(spec)
        if restarted and self.spec.checkpoint.uri and self.spec.checkpoint.every:
            # its workers died with the previous one: the latest checkpoint (none yet: a fresh start)
            spec = {**spec, "checkpoint": {**spec["checkpoint"], "resume": "latest"}}
            self.spec = spec_from_dict(spec)
        e = self.spec.elastic
        host = ray.util.get_node_ip_address()
        # the job's store, in a relay process that admits only holders of its secret (wire/rendezvous.py)
        secret = new_secret()
        self.rendezvous = RendezvousServer(host, secret, e.collective_timeout_s)
        self.record = JobRecord(self.spec, spec, job_id, run_dir, started_at, restarted)
        self.state = CoordinatorState.at_start(e, self.record.events.records)
        self.restarts = self.record.events.count("coordinator_restarted") + (1 if restarted else 0)
        per_node = e.memory_per_node_gib
        self.memory = MemoryWatch(int(per_node * 2**30) if per_node else None)  # what the workers measured
        self.inbox: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # the state, read by the actor's other threads
        self.completions = Completions()  # hellos and train calls in flight, collected as they complete
        self.pool = WorkerPool(e, self.completions, workforce or RayWorkforce(coordinator_name, namespace))
        self.watch = NodeWatch(host, secret, self.spec, self.pool, self.inbox.put, self.record.log)
        self.final = FinalSave(self.spec, self.pool, self.watch, self.rendezvous.store, self.record,
                               self.checkpoint_committed)
        self._worker_args = dict(spec=spec, store_host=host, store_port=self.rendezvous.port,
                                 store_secret=secret, coordinator=coordinator_name, namespace=namespace,
                                 heartbeat_port=self.watch.heartbeats.port)
        self.generations = Generations(self.spec, self.pool, self.watch, self.record, self.rendezvous.store,
                                       self.completions)
        self.generations.drills_fired_before(self.restarts)
        self.result: dict | None = None

    def log(self, kind: str, **fields) -> None:
        self.record.log(kind, **fields)

    def run(self, ended_before) -> None:
        """Drives the job to its result; `ended_before`: the last status of an earlier coordinator
        that ended this job (None: it did not)."""
        try:
            self._drive(ended_before)
        except Exception as exc:  # noqa: BLE001 - a bug here must end the job with its reason, not hang it
            traceback.print_exc()  # where: into the coordinator's log
            message = f"the coordinator failed: {type(exc).__name__}: {exc}"[:400]
            self.log("job_failed", message=message)
            self.result = self.result or {"ok": False, "error": message, "summary": self.record.books.summary(None)}
        finally:
            self.watch.close()
            self._retire(tuple(self.pool), "the job is over")  # spawned ones that never joined too
            self.result = self.result or {"ok": False, "error": "the coordinator ended without a result", "summary": {}}

    def _drive(self, ended_before) -> None:
        c = self.spec.checkpoint
        if self.restarted and ended_before is None and self._take_over():
            self._loop()  # the lost coordinator's generation goes on, from its workers' memory
            return
        self._retire(tuple(self.pool.adopt(None, spawned_ids(self.record.events.records))),
                     "a worker of an earlier coordinator of this job")
        if self.restarted:
            if ended_before is not None:  # it died while lingering: the job is over, and stays so
                self.log("coordinator_restarted", restarts=self.restarts, resume=None)
                self.result = result_of_ended_job(self.run_dir, self.record.events.records, ended_before)
                return
            self.log("coordinator_restarted", restarts=self.restarts,
                     resume="latest checkpoint" if c.uri and c.every else None)
            if not (c.uri and c.every) and self.state.first_generation > 0:  # (none trained yet: nothing lost)
                self._carry_out(Fail("the coordinator was lost, none of its workers was left to take over, and the "
                                     "job saves no checkpoints to resume from"))
                return
        self.log("job_start", name=self.spec.name, workers=self.spec.elastic.workers, job_id=self.job_id)
        if c.uri:  # where the job runs (the CLI checked where it was launched); every job writes its final weights
            try:
                resumed = writable_resume_point(c.uri, c.resume)
            except ValueError as exc:
                self._carry_out(Fail(str(exc)))
                return
            if resumed is not None and resumed[0] >= self.spec.train.steps:
                self.result = self.final.at_resume(*resumed).result
                return
            # the checkpoint resumed is one to fall back to; without one, what memory cannot restore starts over
            self.state = dataclasses.replace(self.state, committed=resumed is not None)
        self.apply(Start())
        self._loop()

    def _loop(self) -> None:
        last_tick = next_listen = next_stuck_look = time.monotonic()
        while self.result is None:
            while not self.inbox.empty():
                item = self.inbox.get_nowait()
                if isinstance(item, NodeNotice):
                    self._on_node_notice(item)
                elif callable(item):  # a note to take on this thread (actor.py)
                    item()
                else:
                    self.apply(item)
            for ref in self.completions.completed(max(0.0, min(0.05, next_listen - time.monotonic()))):
                self._collect(ref)
                if time.monotonic() >= next_listen:  # a thousand reports take a while: silence is not put off
                    next_listen = self._notice_silent_workers()
            for came in self.generations.take_handed_in(time.monotonic()):  # standing calls' reports
                self._report_came(*came)
            self.generations.kill_unresponsive()
            if time.monotonic() >= next_stuck_look:
                next_stuck_look = time.monotonic() + STUCK_POLL_S
                self._notice_stuck_workers()
            if time.monotonic() >= next_listen:
                next_listen = self._notice_silent_workers()
            if self.generations.running is not None and self.generations.running.over():
                self._end_generation()
            if time.monotonic() - last_tick > 0.5:
                last_tick = time.monotonic()
                self._refresh_memory()
                self._notice_unplaceable_workers()
                if (lost := self.watch.lost_while_ready(self.state.ready, last_tick)) is not None:
                    self.apply(lost)  # found dead now, not by the recovery that would take them
                self.apply(Tick())

    # ---- a lost coordinator's workers ---------------------------------------------------------------

    def _take_over(self) -> bool:
        """A lost coordinator's workers taken over with their generation (takeover.py); False: none trained."""
        found = find_generation(self.pool.workforce, self.record.events.records)
        if found is None or found.plan is None:
            return False
        e, plan, events = self.spec.elastic, found.plan, self.record.events.records
        self.record.change_taken_over(plan.number)
        self.log("coordinator_restarted", restarts=self.restarts, resume="workers' memory")
        take_over(found, self.pool, self.watch, self.generations, self._worker_args, e.collective_timeout_s + 30, events)
        self._retire(tuple(found.others), "a worker of the lost coordinator outside its last generation")
        with self.lock:
            self.state = taken_over(self.state, plan, *carried_over(events, e.workers),
                                    committed=bool(self.record.committed_directories()))
        self.log("generation_taken_over", generation=plan.number, step=plan.step, workers=sorted(found.participants))
        return True

    # ---- what comes back from the workers --------------------------------------------------------

    def _collect(self, ref) -> None:
        if self.pool.is_hello(ref):
            self._hello_arrived(ref)
        elif (came := self.generations.collect(ref)) is not None:
            self._report_came(*came)

    def _report_came(self, actor_id: str, report, death: dict | None = None) -> None:
        """A participant's report, its call's answer or handed in through the store (generation_run.py)."""
        if death is not None:
            self.log("worker_lost", actor_id=actor_id, **death)
        if report.outcome.kind in (OutcomeKind.DEAD, OutcomeKind.FAILED):
            self.generations.failed()
        if report.outcome.kind == OutcomeKind.LEFT:
            self._retire((actor_id,), "left after handing its shard over")

    def _hello_arrived(self, ref) -> None:
        came = self.pool.take_hello(ref)
        actor_id, hello = came.actor_id, came.hello
        if came.error is not None:
            self.log("worker_start_failed", actor_id=actor_id, error=came.error)
            self.apply(WorkerStartFailed(actor_id, came.error, lost=came.lost))
            return
        self.record.worker_ready(actor_id, hello)
        if hello.member.node in self.watch.nodes_that_go():  # placed there before Ray or we knew: another is asked for
            self._retire((actor_id,), "it started on a node that goes")
            self.apply(WorkerStartFailed(actor_id, "it started on a node that goes", lost=True))
            return
        self.watch.worker_at(actor_id, hello.member.node)
        self.memory.hello(actor_id, hello.member.node, hello.memory)
        self._refresh_memory()  # its node counts in the plan its readiness may start
        if hello.warning:
            self.log("warning", actor_id=actor_id, message=hello.warning)
            self.record.books.warnings.append(hello.warning)
        self.apply(WorkersReady((hello.member,)))

    def _notice_silent_workers(self) -> float:
        """A participant whose heartbeats stopped is lost (its node vanished): its report will come,
        if ever, only when Ray's health checks give up on its node, so it is counted dead now, with its
        last sign of life as the time of the failure. Returns when to look again (monotonic)."""
        now = time.monotonic()
        silence, next_look = self.watch.look_for_silence(self.generations.training(), now)
        if silence is None:
            return next_look
        self.log("decision", on="Silence", reason=silence.reason, listener_behind_s=round(now - silence.read_until, 3))
        for actor_id in silence.lost:
            self.log("worker_lost", actor_id=actor_id, silent_s=round(silence.read_until - silence.last_heard[actor_id], 2))
        self.watch.nodes_lost(silence.lost, now)
        self._give_up_on(silence.lost, silence.reason, silence.last_heard, now,
                         "silent: presumed lost (with its node, unless others are heard there)")
        return next_look

    def _notice_stuck_workers(self) -> None:
        """A participant alive but not training while its peers went on past it is killed and counted
        lost from when it last moved; the generation fails, and the survivors recover as from any loss.
        Its node stays: its other workers may be well."""
        run = self.generations.running
        if run is None:
            return
        stuck = self.watch.look_for_stuck(run, self.record.live.median_step_s())
        if stuck is None:
            return
        self.log("decision", on="Stuck", reason=stuck.reason)
        for actor_id in stuck.stuck:
            self.log("worker_stuck", actor_id=actor_id, still_s=round(stuck.still_s[actor_id], 2),
                     where=stuck.where[actor_id])
        self._give_up_on(stuck.stuck, f"stuck: {stuck.reason}", stuck.last_moved, time.monotonic(),
                         "stuck: killed (its training stopped behind its peers')")

    def _give_up_on(self, actor_ids, error: str, last_sign: dict, now: float, why: str) -> None:
        """Participants found silent or stuck: dead from their last sign of life (monotonic, as `now`),
        retired (killed), and their generation failed."""
        self.generations.running.count_dead(actor_ids, error, last_sign, now)
        self._retire(actor_ids, why, lost=True)
        self.generations.failed()

    def _end_generation(self) -> None:
        run = self.generations.end()
        plan, results = run.plan, run.results
        for directory in {r.restored_from for r in results.values() if r.restored_from}:
            self.checkpoint_restored(plan.number, directory)
            self.record.add_checkpoint_logs(plan.number, directory)  # (where its candidates were read)
        for directory in [d for r in results.values() for d in r.checkpoints]:
            self.checkpoint_committed(directory, plan.number)
        outcomes = self.generations.close(run)
        members = {m.actor_id for m in plan.generation.members}
        if sum(1 for o in outcomes if o.actor_id in members) < len(members) or \
                any(o.kind == OutcomeKind.FAILED for o in outcomes):
            self._find_own_commits()  # a commit whose note was lost with rank 0 is restored, not started over
        if any(r.outcome.kind == OutcomeKind.DEAD and is_memory_kill(r.outcome.error) for r in results.values()):
            self._memory_killed(plan)  # before the recovery is planned: not into the same death
        self.apply(GenerationEnded(outcomes, coordinator_lost=run.taken_over))

    # ---- checkpoints the workers tell of ---------------------------------------------------------------

    def checkpoint_committed(self, directory: str, generation: int | None = None) -> None:
        """A commit rank 0 told of, or a generation's reports name (on any thread)."""
        if generation is None and self.state.generation is not None:
            generation = self.state.generation.number
        if self.record.committed(directory, generation) and not self.state.committed:
            self.apply(CheckpointCommitted())  # before any decision that follows: a loss may now restore it

    def checkpoint_restored(self, generation: int, directory: str, step: int | None = None) -> None:
        if not self.record.restored(generation, directory, step):
            return
        # now, not only from the generation's reports: should every member be lost, none would name it
        self.record.add_checkpoint_logs(generation, directory)

    def _find_own_commits(self) -> None:
        """This job's commits in its store that no note told of (rank 0 told each as it committed, but
        a note sent just before its process died may never arrive)."""
        c = self.spec.checkpoint
        if self.state.committed or not (c.uri and c.every):
            return
        for directory in commits_since(c.uri, self.started_at, self.log):
            self.checkpoint_committed(directory)

    # ---- carrying out decisions ------------------------------------------------------------------

    def apply(self, event) -> None:
        with self.lock:
            self.state, commands, reason = decide(self.state, event, time.monotonic())
        if not isinstance(event, (Tick, MemorySeen)) or commands:
            self.log("decision", on=type(event).__name__, reason=reason)
        if isinstance(event, GenerationStepped):  # kept for a change whose generation may yet be lost whole
            self.record.books.generation_stepped(event.number, event.at)
        for command in commands:
            self._carry_out(command)

    def _carry_out(self, command) -> None:
        if isinstance(command, Spawn):
            asked_t = time.time()  # before the requests: an autoscaler may answer before the event is written
            joiner = self.state.generation is not None  # it will receive its shard by handover
            asked = self.pool.spawn(command.count, self.watch.placement(), joiner=joiner, asked_at=asked_t,
                                    **self._worker_args)
            self.log("spawn", count=command.count, actor_ids=asked, asked_t=round(asked_t, 4))
        elif isinstance(command, CheckpointNow):
            self.generations.checkpoint_before_leaving(self.state.generation, self.state.leaving)
        elif isinstance(command, RequestSafePoint):
            self.generations.ask_one_member("request_safe_point", self.state.generation)
        elif isinstance(command, StartGeneration):
            try:
                self.generations.start(command.plan)
            except ValueError as exc:  # a checkpoint generation's, where no commit can be read
                self._carry_out(Fail(f"no in-memory copy survived and no checkpoint can be read: {exc}"))
        elif isinstance(command, Retire):
            self._retire(command.actor_ids, "retired", lost=command.lost)
        elif isinstance(command, Finish):
            self._end_with(self.final.finish(self._members(), self.generations.last_plan), finished=True)
        elif isinstance(command, Stop):
            members = self._members() if command.step >= 0 else []
            self._end_with(self.final.stop(command.step, command.checkpoint, members, self.generations.last_plan))
        elif isinstance(command, Warn):
            self.record.warn(command.message)
        elif isinstance(command, Fail):
            self.log("job_failed", message=command.message)
            self._retire(tuple(self.pool), "job failed")
            self.result = {"ok": False, "error": command.message, "summary": self.record.books.summary(None),
                           "bad_input": command.bad_input}

    def _members(self) -> list[str]:
        return [m.actor_id for m in self.state.generation.members]

    def _end_with(self, outcome, finished: bool = False) -> None:
        """What the final save (or a stop's) came to: the job's result, its failure, or a recovery."""
        if isinstance(outcome, SaveFailed):
            self._carry_out(Fail(outcome.message))
        elif isinstance(outcome, LostInSave):  # recovered as from any loss
            outcomes = self.generations.lost_in_final_save(self._members(), outcome.lost)
            self._retire(tuple(outcome.lost), "lost in the final save", lost=True)
            self.apply(GenerationEnded(outcomes))
        elif isinstance(outcome, Ended):
            self.result = outcome.result
            if finished:
                self.apply(FinalWeightsWritten())

    # ---- workers and nodes -----------------------------------------------------------------------

    def _retire(self, actor_ids, why: str, lost: bool = False) -> None:
        for actor_id in actor_ids:
            handle = self.pool.remove(actor_id)
            self.memory.forget(actor_id, time.monotonic())
            if handle is not None:
                self.watch.worker_gone(actor_id, handle, lost, job_over=self.result is not None)
                self.pool.kill(handle)
        if actor_ids:
            self.log("retire", actor_ids=list(actor_ids), why=why)

    def _notice_unplaceable_workers(self) -> None:
        """Workers still starting that no node type of the cluster can host (worker_pool.py)."""
        reason, given_up = self.pool.give_up_unplaceable(time.monotonic(), training=self.state.generation is not None)
        if reason is not None and not given_up:
            self.record.warn(f"a replacement worker can never be placed: {reason}")
        for actor_id in given_up:  # their hellos, when the kill ends them, are not waited for
            self.log("worker_start_failed", actor_id=actor_id, error=reason)
            self._retire((actor_id,), "no node can host it")
            self.apply(WorkerStartFailed(actor_id, reason, bad_input=True))

    def _on_node_notice(self, item: NodeNotice) -> None:
        if here := self.watch.notice(item):  # members leave at a safe point, ready ones not yet in just go: together
            self.apply(PreemptionNotice(here[0], tuple(here[1:])))

    def _refresh_memory(self) -> None:
        """The memory the workers measured (their hellos, their beats), for the plans to come."""
        run = self.generations.running
        view = self.memory.view(self.watch.beats(), run.plan if run is not None else None, time.monotonic())
        if view is not None and view != self.state.memory:
            self.apply(MemorySeen(view))

    def _memory_killed(self, plan) -> None:
        """A worker of `plan` was killed by Ray's memory monitor: no plan of its shape counts on the
        room its node had again (the recovery then drops replicas, or waits for more workers)."""
        self._refresh_memory()
        if self.state.memory is not None:
            self.apply(MemorySeen(self.memory.killed(self.state.memory, plan), killed=True))
