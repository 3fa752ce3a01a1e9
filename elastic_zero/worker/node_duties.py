"""What a worker does for the job beyond its shard: it says where it runs (hello: its node, zone and
process, once its heartbeats have started), it beats (a heartbeat datagram to the coordinator
every HEARTBEAT_EVERY_S, from a process of its own, whatever training is doing: a node that vanishes
goes silent, see heartbeats.py and plan/liveness.py), it takes SIGTERM as a notice that it goes, and one
worker per node watches the node's cloud metadata server when the coordinator asks it to. The
training thread marks its progress here, on the board the beats carry. One per worker, owned by its
Trainer; the coordinator is reached by its name."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

from elastic_zero.cpu_waits import StillnessMeter
from elastic_zero.wire.heartbeats import (NODE_MEMORY_EVERY_S, PHASES, HeartbeatSender, ProgressBoard, beat_token,
                                         beating_started, start_beat_process)
from elastic_zero.node_memory import BeatMemory, capacity_bytes, monitor_threshold, rss_bytes, used_bytes
from elastic_zero.plan.membership import Member
from elastic_zero.preemption.cloud_watcher import CloudWatcher
from elastic_zero.preemption.sigterm import catch_sigterm, termination_grace_s
from elastic_zero.job.spec import HEARTBEAT_EVERY_S
from elastic_zero.job.build import DTYPES
from elastic_zero.protocol import Hello
from elastic_zero.zero.memory_facts import model_memory, own_tensor_bytes
from elastic_zero.worker.faults import ray_node_id
from elastic_zero.worker.node_age import raylet_started_at
from elastic_zero.worker.start_clock import StartClock


BEAT_START_TIMEOUT_S = 30.0  # a Python process's start, on a machine as busy as CI's: well under this


@functools.lru_cache(maxsize=4)
def coordinator_handle(name: str, namespace: str):
    import ray

    return ray.get_actor(name, namespace=namespace)


class NodeDuties:
    def __init__(self, spec, actor_id: str, coordinator: str | None, namespace: str | None) -> None:
        self._spec, self._actor_id, self._coordinator, self._namespace = spec, actor_id, coordinator, namespace
        self._cloud_watcher: CloudWatcher | None = None
        self._beats = None  # the beat process (it ends with this worker's process)
        self._sender: HeartbeatSender | None = None  # where there is none: the thread that beats sends with it
        self.board: ProgressBoard | None = None  # this worker's progress, which its beats carry (heartbeats.py)
        self._hang_in: str | None = None  # a hang drill armed for later in the step: "data" or "collective"
        self._collectives_armed = 0  # the collectives entered since a "collective" hang was armed

    def mark(self, **progress) -> None:
        """The training thread's progress (generation, steps, phase) on the board its beats read."""
        if self.board is not None:
            self.board.mark(**progress)
        if self._hang_in is not None and progress.get("phase") == self._hang_in:
            threading.Event().wait()  # the drill: inside the data read, alive (beating), never training again

    def tick(self) -> None:
        """A micro batch or an eval batch begins: training moves, though no collective or phase shows it
        (an evaluation at stage 1 or 2 enters none until its end)."""
        if self.board is not None:
            self.board.tick()

    def collective_entered(self) -> None:
        """The training group enters a collective (zero/comm.py's on_collective): counted on the board."""
        if self._hang_in == "collective":
            self._collectives_armed += 1
            if self._collectives_armed == 2:  # the drill: its peers entered this one, it never does
                threading.Event().wait()
        if self.board is not None:
            self.board.collective()

    def hang(self, action: str) -> None:
        """A hang drill (job/sections.py HANG_ACTIONS): now ("hang"), or armed for later in this step."""
        if action == "hang":
            threading.Event().wait()
        self._hang_in, self._collectives_armed = action.removeprefix("hang_in_"), 0

    def hello(self, memory: dict, start: StartClock | None = None) -> Hello:
        """Where this worker runs, once its first beat is out; `memory`: memory_facts() of its model;
        `start`: the clock of its start (start_clock.py), whose last phase ends here."""
        node, warning = os.environ.get("ELASTIC_ZERO_NODE"), ""
        actor_id = self._actor_id
        if not node:
            node, problem = ray_node_id()
            if node is None:  # buddies may then share this machine: said, not hidden
                node, warning = f"unknown-{actor_id}", f"the Ray node of {actor_id} is unknown ({problem})"
        warnings = "; ".join(filter(None, (warning, self._beats_started())))
        if start is not None and "hello" not in start.phases:
            start.lap("hello")
        return Hello(Member(actor_id, node=node, zone=os.environ.get("ELASTIC_ZERO_ZONE", "")), warnings, os.getpid(),
                     memory, raylet_started_at(), start.told() if start is not None else {})

    def start_beating(self, coordinator_host: str, heartbeat_port: int | None, secret: bytes) -> None:
        """First thing in the worker's start: its beat process starts while the model is built."""
        if self._coordinator and self._spec.elastic.heartbeat_timeout_s and heartbeat_port:
            token = beat_token(secret)
            self.board = ProgressBoard.create()
            try:
                self._beats = start_beat_process(coordinator_host, heartbeat_port, token, self._actor_id,
                                                 HEARTBEAT_EVERY_S, self.board.path)
            except OSError as exc:  # no process to spare (EAGAIN, ENOMEM): a thread beats, stalls and all
                print(f"elastic_zero: {self._actor_id} beats from a thread: its beat process could not start "
                      f"({exc})", file=sys.stderr)
                self._sender = HeartbeatSender(coordinator_host, heartbeat_port, token)
                threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def follow(self, coordinator_host: str, heartbeat_port: int | None, secret: bytes) -> None:
        """A coordinator that replaced a lost one took this worker over: beat to its listener from now on."""
        if not heartbeat_port or self.board is None:
            return
        token = beat_token(secret)
        if self._sender is not None:  # beats from a thread: it sends to the new listener from its next beat
            self._sender = HeartbeatSender(coordinator_host, heartbeat_port, token)
            return
        self._beats.kill()
        self._beats.wait()
        generation, steps, _, phase, _ = self.board.read()
        board = ProgressBoard.create()  # the same progress, on a board the new beat process can map
        board.mark(generation=generation, steps=steps, phase=PHASES[phase])
        self.board = board
        self._beats = start_beat_process(coordinator_host, heartbeat_port, token, self._actor_id, HEARTBEAT_EVERY_S,
                                         self.board.path)
        warning = self._beats_started()
        if warning:
            print(f"elastic_zero: {warning}", file=sys.stderr)

    def _beats_started(self) -> str:
        """Wait until this worker's first heartbeat is out, before its hello says it is ready: the
        coordinator counts its silence from the generation it joins (heartbeats.start_beat_process).
        A warning if it is not, the worker still ready (its silence may then be taken for a loss)."""
        if self._beats is None or self._beats.stdout.closed:
            return ""
        if beating_started(self._beats, BEAT_START_TIMEOUT_S):
            if self.board is not None:
                self.board.unlink()  # mapped by both: nothing else needs its name
            return ""
        return f"the heartbeats of {self._actor_id} had not started {BEAT_START_TIMEOUT_S:g} s after its start"

    def take_sigterm_as_notice(self) -> None:
        if "sigterm" in self._spec.preemption.watch:
            catch_sigterm(self._on_sigterm, termination_grace_s(self._spec.preemption.sigterm_grace_s))

    def _beat(self) -> None:
        self.board.unlink()
        starved, memory = StillnessMeter(os.getpid()), BeatMemory(os.getpid(), NODE_MEMORY_EVERY_S)
        while True:
            at = self.board.read()
            self._sender.beat(self._actor_id, at, memory=memory(), waited_ms=starved(at))
            time.sleep(HEARTBEAT_EVERY_S)

    def _on_sigterm(self, grace_s: float) -> None:
        """SIGTERM (a pod deleted, a node's agent stopping it): a preemption notice of this worker,
        which hands its shard over at the next safe point; it goes at the grace period's end anyway."""
        coordinator_handle(self._coordinator, self._namespace).preemption_notice.remote(self._actor_id, grace_s,
                                                                                       "sigterm")

    def watch_node(self, node: str) -> None:
        """Watch this node's cloud metadata server for the job (the coordinator picks one worker per node)."""
        p = self._spec.preemption
        clouds = p.clouds()
        if self._cloud_watcher is not None or not clouds:
            return
        def coordinator():  # looked up at each note: a replacement of a lost one has a new handle
            return coordinator_handle(self._coordinator, self._namespace)

        self._cloud_watcher = CloudWatcher(
            clouds, p.endpoints(), p.poll_s,
            tell=lambda n: coordinator().node_notice.remote(node, n.source, n.deadline_at, n.detail, n.ack),
            log=lambda message, problem: coordinator().watcher_note.remote(node, message, problem))
        threading.Thread(target=self._cloud_watcher.run, daemon=True, name="cloud-watcher").start()

    def acknowledge_notice(self, ack: tuple) -> bool | str:
        """Azure's events of this node's notice, acknowledged once its workers handed over: True or why not."""
        if self._cloud_watcher is None:
            return "this worker does not watch its node"
        return self._cloud_watcher.acknowledge(tuple(ack))


def memory_facts(spec, model=None, wrap=None, optimizer=None, device=None) -> dict:
    """What the coordinator plans memory with (plan/memory.py): the node's capacity and Ray's
    threshold, what this process holds beside its model's own tensors, the model's state facts."""
    facts = {"capacity": capacity_bytes(), "threshold": monitor_threshold(), "used": used_bytes(),
             "rss": rss_bytes(os.getpid())}
    if device is not None and device.type == "cuda":  # the engine's state is there, not in the node's memory
        import torch

        facts["device_capacity"] = torch.cuda.get_device_properties(device).total_memory
    if model is not None:
        facts["own_tensors"] = own_tensor_bytes(model)
        facts["model"] = model_memory(model, wrap, spec.zero.stage, DTYPES[spec.zero.compute_dtype], optimizer)
    return facts
