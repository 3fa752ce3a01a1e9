"""Simulated workers for the control plane's bench: many to a process, speaking the coordinator's
protocol (protocol.py) on a fake step clock, with no model and no torch training.

What they do as real workers do, through the same channels:
- hello() answers with a Member on a simulated node (SIM_NODE_FORMAT: per_node workers a node);
- heartbeats, one datagram a worker as worker/node_duties.py sends them, from a process of its own
  per host;
- train(plan): a store connection of its own for the generation, through the coordinator's relay,
  and the rendezvous of torch's NCCL process group (rank 0 sets the communicator's id under the
  group's prefix, every other rank gets it), then the barrier of its first collective; then steps of
  `step_s` each, on one clock for the generation (real ranks keep step through their all-reduces);
  rank 0 tells the coordinator the generation stepped and its progress every PROGRESS_EVERY_S; a report at the end
  with one sample record per step and the replicas it would hold; the call stands, as a real one
  does, handing its report in through the store and training the plan set next (sim_plans_after.py);
- safe points end every member at the same step, as the step's closing all-reduce makes real ranks
  do: the host of the member asked agrees the step with a StepReferee (sim_referee.py), which tells every host;
- an abort (the generation's end key in the store, generation_ends.py: one watch per host) ends
  the generation at once ("failed"); leavers hand over and go ("left").

A node can be frozen (freeze_node): its workers go silent and answer nothing, like a machine that
vanished, until the coordinator retires them.
"""

from __future__ import annotations

import os
import threading
import time

from elastic_zero.testing.sim_beats import beat_for_host
from elastic_zero.wire.generation_ends import GenerationEndWatch
from elastic_zero.testing.sim_plans_after import PlansAfter
from elastic_zero.wire.standing_calls import hand_in
from elastic_zero.plan.batches import rank_positions
from elastic_zero.plan.membership import Member
from elastic_zero.protocol import GenerationPlan, Hello, Outcome, OutcomeKind, Report, unpack_plan

SIM_NODE_FORMAT = "sim-node-{:04d}"
UNIQUE_ID_BYTES = 128  # an NCCL unique id
PROGRESS_EVERY_S = 0.5  # as a real rank 0 (worker/coordinator_notes.py)
PLAN_METHODS = ("train", "checkpoint_now")  # their first argument is a packed plan (protocol.pack_plan)


class _Member:
    def __init__(self, actor_id: str, node: str, args: dict) -> None:
        self.actor_id, self.node, self.args = actor_id, node, args
        self.frozen = threading.Event()
        self.killed = threading.Event()
        self.aborted: dict[int, threading.Event] = {}
        self.aborted_at: dict[int, float] = {}  # generation -> when its abort came (epoch)
        self.store = None  # the worker's own store connection
        self.generation_store = None  # the current generation's (a process group's clone)
        self.step = 0


class SimulatedHost:
    """Simulated workers in one process (a threaded Ray actor). The coordinator reaches each through
    a SimulatedHandle; the bench reaches the host to freeze nodes and read what its workers saw."""

    def __init__(self, step_s: float, referee) -> None:
        self.step_s, self.referee = step_s, referee
        self._members: dict[str, _Member] = {}
        self._known: dict[str, threading.Event] = {}  # calls may run before the spawn that made the member
        self._lock = threading.Lock()
        self._changed = threading.Condition()  # notified when what a training member waits on changes (_wake)
        self._starting = threading.Lock()
        self._relay = None
        self._ends = None  # the watch of the generations' ends, made with the relay
        self._stop_at: dict[int, int] = {}  # generation -> the step its safe point ends (-1: being agreed)
        self.safe_point_requests = 0
        self._stalls: dict[int, float] = {}  # generation -> when a member was lost (stall())
        self._clocks: dict[int, tuple[int, float]] = {}  # generation -> (its first step, when that step began)
        self.plan_arrivals: dict[int, dict[str, float]] = {}  # generation -> actor -> when train(plan) came
        self.rendezvous: dict[int, dict[str, tuple[float, float]]] = {}  # generation -> actor -> (began, done)
        self._beats = None  # the pipe to the process that beats for this host's workers (beat_for_host)
        self._longest_beat_gap = None  # between two rounds of its heartbeats: a starved one would fake a lost node
        self._beats_refused = None  # beats the kernel refused to send (sendto raised)
        self.train_calls = 0  # train() calls taken (standing ones take several generations each)
        self._plans_after = None  # where its members' standing calls wait for the next plan, made with the relay

    # ---- the bench's side --------------------------------------------------------------------

    def ping(self) -> int:
        return os.getpid()

    def stall(self, generation: int, at: float) -> None:
        """A member of `generation` is lost at epoch time `at`: the others finish no step that ends
        after it (real ranks wait in the step's all-reduce for the lost one) until they are aborted."""
        self._stalls[generation] = at
        self._wake()

    def freeze_node(self, node: str) -> list[str]:
        """The node vanishes: its workers stop beating and answering."""
        with self._lock:
            frozen = [m for m in self._members.values() if m.node == node and not m.killed.is_set()]
            for m in frozen:
                m.frozen.set()
            self._beating()
        self._wake()
        return [m.actor_id for m in frozen]

    def stop_at(self, generation: int, step: int) -> None:
        """The referee's word: `generation` ends at a safe point after `step`."""
        self._stop_at[generation] = step
        self._wake()

    def seen(self) -> dict:
        """Copies (each dict copy is atomic under the GIL; the workers' threads write on meanwhile)."""
        return {"plan_arrivals": {g: dict(v) for g, v in list(self.plan_arrivals.items())},
                "rendezvous": {g: dict(v) for g, v in list(self.rendezvous.items())},
                "longest_beat_gap_s": self._longest_beat_gap.value if self._longest_beat_gap else 0.0,
                "beats_refused": self._beats_refused.value if self._beats_refused else 0,
                "safe_point_requests": self.safe_point_requests, "train_calls": self.train_calls}

    # ---- the workforce's side ----------------------------------------------------------------

    def spawn(self, actor_id: str, node: str, args: dict) -> None:
        member = _Member(actor_id, node, args)
        with self._starting:  # the first spawns come at once: one relay and one beating process
            self._start_once(args)
        member.store = self._relay.client(args["spec"]["elastic"]["collective_timeout_s"])
        with self._lock:
            self._members[actor_id] = member
            self._known.setdefault(actor_id, threading.Event()).set()
            self._beating()

    def _start_once(self, args: dict) -> None:
        if self._relay is None:
            import multiprocessing

            from elastic_zero.wire.rendezvous import LocalRelay

            self._relay = LocalRelay(args["store_host"], args["store_port"], args["store_secret"])
            # one watch of the generations' ends for the host's members, as each real worker has its own
            timeout_s = args["spec"]["elastic"]["collective_timeout_s"]
            self._ends = GenerationEndWatch(self._relay.client(timeout_s), self._abort_everywhere)
            self._plans_after = PlansAfter(lambda: self._relay.client(timeout_s))
            context = multiprocessing.get_context("spawn")  # not a fork of a process with threads
            self._longest_beat_gap = context.Value("d", 0.0)
            self._beats_refused = context.Value("q", 0)
            self._beats, theirs = context.Pipe(duplex=False)[::-1]
            context.Process(target=beat_for_host, daemon=True, args=(
                theirs, args["store_host"], args["heartbeat_port"], args["store_secret"], self.step_s,
                self._longest_beat_gap, self._beats_refused)).start()

    def kill(self, actor_id: str) -> None:
        member = self._member(actor_id)
        member.killed.set()
        for event in member.aborted.values():
            event.set()
        member.store = member.generation_store = None
        with self._lock:
            self._beating()
        self._wake()

    def call(self, actor_id: str, method: str, *args):
        member = self._member(actor_id)
        if member.frozen.is_set() and not member.killed.is_set():
            member.killed.wait()  # a vanished machine answers nothing
        if member.killed.is_set():
            raise RuntimeError(f"simulated worker {actor_id} was killed")
        # each simulated worker unpacks its own copy of a plan, as each real one does in its process
        if method in PLAN_METHODS:
            args = (unpack_plan(args[0]),) + args[1:]
        return getattr(self, "_" + method)(member, *args)

    def _member(self, actor_id: str) -> _Member:
        with self._lock:
            known = self._known.setdefault(actor_id, threading.Event())
        if not known.wait(60):
            raise RuntimeError(f"simulated worker {actor_id} was never spawned")
        return self._members[actor_id]

    # ---- the protocol ------------------------------------------------------------------------

    def _hello(self, m: _Member) -> Hello:
        return Hello(Member(m.actor_id, node=m.node))

    def _request_safe_point(self, m: _Member, number: int) -> None:
        """The step two steps on by the generation's clock (every host learns it before any member
        gets there) is agreed with the referee."""
        with self._lock:
            self.safe_point_requests += 1
        if number in self._stop_at:
            return
        self._stop_at[number] = -1
        first_step, clock = self._clocks.get(number, (m.step, None))
        now = time.time() if clock is None else max(time.time(), clock)
        running = first_step + (0 if clock is None else int((now - clock) / self.step_s))
        import ray

        self._stop_at[number] = ray.get(self.referee.agree.remote(number, running + 2))  # (and stop_at() from it)
        self._wake()

    def _request_checkpoint(self, m: _Member, number: int) -> None:
        pass  # simulated workers save nothing: a job with checkpoints is not what this bench measures

    def _abort_generation(self, m: _Member, number: int, wake: bool = True) -> None:
        m.aborted_at.setdefault(number, time.time())
        m.aborted.setdefault(number, threading.Event()).set()  # it may come before train() entered the generation
        if wake:
            self._wake()

    def _abort_everywhere(self, number: int) -> None:
        """The coordinator aborted generation `number` (generation_ends.py): every member here hears
        it, but those on a vanished node."""
        with self._lock:
            members = [m for m in self._members.values() if not m.frozen.is_set()]
        for m in members:
            self._abort_generation(m, number, wake=False)
        self._wake()

    def _watch_node(self, m: _Member, node: str) -> None:
        pass  # no cloud metadata server on a simulated node

    def _acknowledge_notice(self, m: _Member, ack: tuple) -> str:
        return "a simulated node has no cloud to acknowledge"

    def _memory_report(self, m: _Member) -> dict:
        return {}

    def _settle_saves(self, m: _Member) -> dict:
        return {"checkpoints": [], "checkpoint_errors": []}

    def _checkpoint_now(self, m: _Member, plan: GenerationPlan, final: bool = False) -> dict:
        """Rank 0 names the step's directory as committed, marked in the run directory as simulated."""
        if plan.generation.members[0].actor_id != m.actor_id:
            return {"checkpoints": [], "checkpoint_errors": []}
        root = os.path.join(m.args["spec"]["checkpoint"]["uri"], f"step-{m.step:010d}")
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "SIMULATED"), "w") as fh:
            fh.write("written by a simulated worker of bench control-plane: no weights\n")
        return {"checkpoints": [root], "checkpoint_errors": []}

    def _train(self, m: _Member, plan: GenerationPlan, stand: bool = False) -> Report:
        """As a real worker's call (worker/actor.py): one generation, or, standing, each that follows
        while the member takes part, the reports handed in through the store."""
        with self._lock:
            self.train_calls += 1
        while True:
            report = self._train_one(m, plan)
            if not stand or report.outcome.kind in (OutcomeKind.LEFT, OutcomeKind.DEAD):
                return report
            hand_in(m.store, plan.number, report)
            packed = self._plans_after.wait(plan.number, lambda: m.killed.is_set() or m.frozen.is_set())
            if packed is None:  # killed; a member of a frozen node answers nothing until it is
                m.killed.wait()
                raise RuntimeError(f"simulated worker {m.actor_id} was killed")
            plan = unpack_plan(packed)  # each unpacks its own copy, as each real worker does
            if m.actor_id not in plan.participants:
                return report

    def _train_one(self, m: _Member, plan: GenerationPlan) -> Report:
        entered = time.time()
        self.plan_arrivals.setdefault(plan.number, {})[m.actor_id] = entered
        self._ends.watch(plan.number)
        aborted = m.aborted.setdefault(plan.number, threading.Event())
        members = [x.actor_id for x in plan.generation.members]
        rank = members.index(m.actor_id) if m.actor_id in members else None
        spec = m.args["spec"]
        timeout_s = spec["elastic"]["collective_timeout_s"]
        try:
            started = self._rendezvous(m, plan, aborted, timeout_s)
        except Exception as exc:  # noqa: BLE001 - a peer never came: a failed collective, as for real ranks
            return Report(Outcome(m.actor_id, OutcomeKind.FAILED, plan.step, error=f"rendezvous: {exc}"[:300]),
                          ended_at=time.time(), generation=plan.number, entered_at=entered)
        m.step = max(plan.step, 0)
        with self._lock:
            if plan.number not in self._clocks:  # the first of this host's members through: its beats count steps now
                here = [a for a in plan.participants if a in self._members]
                self._beats.send(("clock", plan.number, m.step, started, here))
            self._clocks[plan.number] = (m.step, started)
        if rank is None:  # a leaver: its shard went over in the handover
            return Report(Outcome(m.actor_id, OutcomeKind.LEFT, m.step), ended_at=time.time(), generation=plan.number,
                          entered_at=entered)
        every = spec["elastic"]["replicate_every"]
        every = 1 if every == "auto" else every  # (simulated steps have no copies to measure)
        world, batch, steps = len(members), spec["train"]["global_batch"], spec["train"]["steps"]
        kind, final = self._steps_until_the_end(m, plan, aborted, rank, started, steps)
        if kind == OutcomeKind.DEAD:
            return Report(Outcome(m.actor_id, OutcomeKind.DEAD), ended_at=time.time())
        first, m.step = m.step, final
        # every handover commits the new layout at entry; then every `every` steps, and at a safe point
        committed = final if kind == OutcomeKind.SAFE_POINT else max(first, final - final % every if every else first)
        log = tuple((s, rank, p.start, len(p)) for s in range(first, final)
                    for p in (rank_positions(s, batch, world, rank),))
        step_ends = tuple(started + (i + 1) * self.step_s for i in range(final - first))
        error = "simulated collective failed: the generation was aborted" if kind == "failed" else ""
        # as the real replicas: the step committed last and the one before it (a swap keeps both until it is
        # done), so that ranks stopped a step apart by an abort still share a step
        held = tuple(sorted({max(plan.step, committed - every), committed})) if every else ()
        outcome = Outcome(m.actor_id, kind, m.step, own_steps=held, ward_steps=held, error=error,
                          snapshot_generation=plan.number)
        return Report(outcome, ended_at=time.time(), generation=plan.number, entered_at=entered, rank=rank,
                      log=log, step_times=(self.step_s,) * len(log), step_ends=step_ends,
                      protect_times=(0.0,) * len(log),
                      first_step_at=started if log else None, last_loss=1.0 if log else None,
                      losses=tuple((s, 1.0) for s, *_ in log))

    def _steps_until_the_end(self, m: _Member, plan: GenerationPlan, aborted: threading.Event, rank: int,
                             started: float, steps: int) -> tuple[str, int]:
        """How the member's part of the generation ends and at which step, on the generation's clock
        (step k done at `started` + k * step_s; none done past a stall): aborted or killed (failed),
        its node frozen (dead), a safe point (the agreed step), or the job's last step. The member
        sleeps until one of those can have happened, woken by any change (_wake), so that 1,024 of
        them cost nothing per step; rank 0 wakes to tell the coordinator its progress, as a real
        rank 0 does."""
        first = m.step

        def done_by(t: float) -> int:
            until = min(t, self._stalls.get(plan.number, t))
            return min(steps, first + max(0, int((until - started) / self.step_s)))

        told_at = None  # when rank 0 last told the coordinator its progress (None: not yet this generation)
        while True:
            with self._changed:
                now = time.time()
                done, stop = done_by(now), self._stop_at.get(plan.number, -1)
                if aborted.is_set() or m.killed.is_set():  # its steps end where the abort found them, not where it woke
                    return OutcomeKind.FAILED, done_by(m.aborted_at.get(plan.number, now))
                if m.frozen.is_set():
                    break
                target = min(steps, max(stop, first + 1)) if stop >= 0 else steps
                if done >= target:  # every member ends at the agreed step, however late its thread woke
                    return (OutcomeKind.SAFE_POINT if target < steps else OutcomeKind.FINISHED), target
                due = started + (target - first) * self.step_s
                if due > self._stalls.get(plan.number, due):  # never, on this clock: only a change ends the wait
                    due = float("inf")
                if rank == 0:
                    tell_at = started + self.step_s if told_at is None else told_at + PROGRESS_EVERY_S
                    if done > first and now >= tell_at:
                        self._changed.release()  # (Ray calls are not made holding what the others wait on)
                        try:
                            told_at = self._tell_progress(m, plan, done, told_at is None)
                        finally:
                            self._changed.acquire()
                        continue
                    due = min(due, tell_at)
                self._changed.wait(None if due == float("inf") else max(0.0, due - now))
        m.killed.wait()  # a vanished machine answers nothing
        return OutcomeKind.DEAD, m.step

    def _wake(self) -> None:
        """Something a training member waits on changed: an abort, a kill, a freeze, a safe point."""
        with self._changed:
            self._changed.notify_all()
        if self._plans_after is not None:  # (a member standing between generations is killed or frozen)
            self._plans_after.wake()

    def _rendezvous(self, m: _Member, plan: GenerationPlan, aborted: threading.Event, timeout_s: float) -> float:
        """A store connection for the generation, the NCCL group's rendezvous on it, and the barrier its
        first collective makes: every participant counts itself in, the last one sets the generation's
        clock, which the others wait for. Returns that clock (epoch seconds): the steps end on it."""
        began = time.time()
        m.generation_store = None  # the previous generation's group (and its connection) is gone
        store = self._relay.client(timeout_s)
        m.generation_store = store
        prefix = f"g{plan.number}/train/"
        if plan.participants[0] == m.actor_id:
            store.set(prefix + "0", b"\0" * UNIQUE_ID_BYTES)
        else:
            _get(store, prefix + "0", aborted, timeout_s)  # waits until rank 0 has set it
        if store.add(prefix + "arrived", 1) == len(plan.participants):
            store.set(prefix + "clock", repr(time.time()))
        clock = float(_get(store, prefix + "clock", aborted, timeout_s).decode())
        self.rendezvous.setdefault(plan.number, {})[m.actor_id] = (began, time.time())
        return clock

    def _tell_progress(self, m: _Member, plan: GenerationPlan, done: int, first_time: bool) -> float:
        from elastic_zero.worker.node_duties import coordinator_handle

        coordinator = coordinator_handle(m.args["coordinator"], m.args["namespace"])
        if first_time:
            coordinator.generation_stepped.remote(plan.number)
        now = time.time()
        coordinator.progress_note.remote(plan.number, done, 1.0, self.step_s, now, None)
        return now

    # ---- liveness ------------------------------------------------------------------------------

    def _beating(self) -> None:
        """Tell the beating process which workers beat now (after a spawn, a freeze, a kill)."""
        if self._beats is not None:
            self._beats.send([a for a, m in self._members.items() if not (m.frozen.is_set() or m.killed.is_set())])


def _get(store, key: str, aborted: threading.Event, timeout_s: float) -> bytes:
    """The key's value once set; given up when the generation is aborted (a real rank's group build
    is), or after `timeout_s`."""
    import datetime

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=0.5))
            return store.get(key)
        except RuntimeError:  # torch's DistStoreError: not set yet
            if aborted.is_set() or time.monotonic() > deadline:
                raise
