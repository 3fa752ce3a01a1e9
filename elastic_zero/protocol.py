"""What passes between the coordinator and its workers: frozen plain data, imported by both sides
(neither imports the other).

coordinator -> worker: a GenerationPlan (packed: pack_plan(); a train(plan) call for a worker's first
generation, then through the store while its call stands: standing_calls.py), a safe-point request
for one generation number, and its end or abort (a store key: generation_ends.py).
worker -> coordinator: a Hello when it has started (or the one-line reason it could not), an
Outcome with its report when its part of a generation ends (handed in through the store, or the
call's answer), and one "stepped" note per generation.
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass, field, fields
from enum import Enum

from elastic_zero.plan.membership import Generation, Member
from elastic_zero.report_columns import packed


class _Named(str, Enum):
    """A name from a closed set that is a str too: compared with, written to JSON and formatted as its
    value (as 3.11's StrEnum, on every Python this package runs on)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Source(_Named):
    """Where a generation's state comes from."""

    INIT = "init"  # a fresh model (or the checkpoint a job resumes from)
    LIVE = "live"  # the members' current engine state, handed over at a safe point
    SNAPSHOT = "snapshot"  # a replicated step: each rank's own snapshot or its buddy's replica
    CHECKPOINT = "checkpoint"  # the latest committed checkpoint (memory holds no complete step)
    RESTART = "restart"  # the job's initial weights (neither memory nor a checkpoint holds a step)


class OutcomeKind(_Named):
    """How one participant's part of a generation ended."""

    FINISHED = "finished"  # every step done
    SAFE_POINT = "safe_point"  # stopped at the safe point the coordinator asked for
    FAILED = "failed"  # a collective failed (a peer lost, an abort, a timeout) or a bug
    LEFT = "left"  # a leaver that handed its shard over
    DEAD = "dead"  # its process or node died, or it was killed (silent, stuck)


@dataclass(frozen=True)
class Hello:
    """A worker that started: where it runs, and what it could not find out about that."""

    member: Member
    warning: str = ""  # e.g. the node could not be identified, so buddies may share a machine
    pid: int = 0  # its process on its node: for py-spy and the benches' memory sampling (0: not a process)
    # its node's memory (capacity, Ray's threshold, used), its own RSS and its model's tensors in
    # it, and the model's state facts (plan/memory.py ModelMemory): what the coordinator plans with
    memory: dict = field(default_factory=dict)
    node_up_at: float | None = None  # when its node's raylet started (epoch seconds; None: unknown)
    start_s: dict = field(default_factory=dict)  # its start by phase (worker/start_clock.py; empty: not told)


@dataclass(frozen=True)
class GenerationPlan:
    generation: Generation
    previous: Generation | None
    participants: tuple[str, ...]  # the handover group: new members by rank, then leavers holding shards
    holder_of_old: tuple[int, ...]  # participant index holding each old rank's shard
    source: Source
    step: int  # the optimizer step the generation starts from
    leaving: tuple[str, ...]  # participants that exit after the handover
    cause: str
    # for source "checkpoint": the committed checkpoints, newest commit first; the members restore
    # the first one every member can read
    checkpoints: tuple[str, ...] = ()
    replicas: bool = True  # the members keep buddy replicas (elastic.replicate_every, where they fit)

    @property
    def number(self) -> int:
        return self.generation.number


def pack_plan(plan: GenerationPlan) -> bytes:
    """A plan packed once for all of its participants, sent to each by value. At 1,024 members a
    plan is 50-150 KB of pickle (the node ids repeat). As an ObjectRef (ray.put) each callee resolved
    and unpickled it through the object store: 1,024 calls to simulated workers on two cores took
    1.6 s to arrive; as bytes inlined in each call, 0.4 s (compressed, 15 KB). Plain bytes, where a
    dataclass would go through cloudpickle, cost the caller's Ray 0.3 us a call to serialize, not 8."""
    return zlib.compress(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL), 1)


def unpack_plan(packed: bytes) -> GenerationPlan:
    """What pack_plan() packed (about 0.5 ms at 1,024 members)."""
    return pickle.loads(zlib.decompress(packed))


@dataclass(frozen=True)
class Outcome:
    """How one participant's part of a generation ended."""

    actor_id: str
    kind: OutcomeKind
    step: int = 0
    own_steps: tuple[int, ...] = ()
    ward_steps: tuple[int, ...] = ()
    error: str = ""
    bug: str = ""  # the error, when it did not come from communication (a peer lost, an abort, a timeout)
    snapshot_generation: int = -1  # the generation whose ranks own_steps and ward_steps describe
    # (generation, own_steps, ward_steps): the replicas of the layout snapshot_generation was built
    # from, kept until the new layout is committed on every rank
    earlier: tuple = ()

    def replicas_of(self, generation: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(own_steps, ward_steps) of the replicas this participant holds in `generation`'s ranks."""
        if self.snapshot_generation == generation:
            return self.own_steps, self.ward_steps
        if self.earlier and self.earlier[0] == generation:
            return tuple(self.earlier[1]), tuple(self.earlier[2])
        return (), ()




@dataclass(frozen=True)
class Report:
    """What one participant tells the coordinator when its part of a generation ends: how it ended,
    what it trained (sample records), and what it measured."""

    outcome: Outcome
    ended_at: float
    generation: int = -1
    entered_at: float | None = None
    rank: int | None = None  # its rank in the generation (None: a leaver, or it never got one)
    log: tuple = ()  # (step, rank, first sample position, count) of each step it committed
    ward_log: tuple = ()  # the same rows of its ward, which came with the ward's replica
    step_times: tuple = ()
    step_ends: tuple = ()  # the epoch time each step it ran was done, in the order of step_times
    protect_times: tuple = ()  # of each step's time, the seconds of its commit (replicas) and checkpoint save
    first_step_at: float | None = None
    last_loss: float | None = None
    last_metrics: dict = field(default_factory=dict)  # the loss function's extra metrics at the last step
    losses: tuple = ()  # (step, loss) of every step it ran (every rank sees the same loss)
    evals: tuple = ()  # one dict per evaluation it took part in (step, loss, metrics, samples, perplexity)
    phases_s: dict = field(default_factory=dict)  # seconds in each phase of entering the generation
    received_bytes: int = 0  # state it took in to enter the generation: from peers (a handover) or a checkpoint
    checkpoint_stall_s: tuple = ()
    checkpoint_errors: tuple = ()
    checkpoints_skipped: tuple = ()  # steps whose periodic save was skipped: the last one was still being written
    checkpoints: tuple = ()  # directories it committed (rank 0)
    restored_from: str | None = None  # the checkpoint it restored, if any

    def __reduce__(self):
        """Pickled (a train call's return) with its per-step columns packed (report_columns.py)."""
        return _report_from, (packed({f.name: getattr(self, f.name) for f in fields(self)}),)

    @classmethod
    def made_from(cls, making: dict, outcome: Outcome, ended_at: float) -> "Report":
        """A worker's report in the making (a dict of lists, and keys of its own besides), frozen,
        with how the generation ended for it."""
        names = {f.name for f in fields(cls)}
        return cls(outcome=outcome, ended_at=ended_at,
                   **{k: tuple(v) if isinstance(v, list) else v for k, v in making.items() if k in names})


def _report_from(values: dict) -> Report:
    """A Report again from what its __reduce__ gave."""
    return Report(**values)
