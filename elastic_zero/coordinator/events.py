"""What the coordinator's state machine takes (events) and gives (commands): plain frozen records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from elastic_zero.plan.membership import Member
from elastic_zero.preemption.notices import Notice
from elastic_zero.protocol import GenerationPlan, Outcome

@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class WorkersReady:
    members: tuple[Member, ...]


@dataclass(frozen=True)
class WorkerStartFailed:
    actor_id: str
    error: str
    lost: bool = False  # its process or node died (Ray's error), rather than its start failing
    bad_input: bool = False  # the job asks for what the cluster cannot give (the error names the field)


@dataclass(frozen=True)
class ScaleRequested:
    workers: int


@dataclass(frozen=True)
class PreemptionNotice:
    """Workers that go soon: one (its SIGTERM, a drill), or every worker of the job on a noticed node,
    decided on together, so that the hand-off is planned knowing all of them."""

    actor_id: str
    others: tuple[str, ...] = ()

    @property
    def actor_ids(self) -> tuple[str, ...]:
        return (self.actor_id, *self.others)


@dataclass(frozen=True)
class ReadyWorkersLost:
    """Workers started and ready beside the generation (standing by, or waiting to join) whose
    process ended or whose beats stopped: replaced now, not found dead by the plan that takes them."""

    actor_ids: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class NodeNotice:
    """A node is to go (a cloud's notice, Ray draining it): the actor turns it into a
    PreemptionNotice for each of the job's workers there; decide() never sees it."""
    node: str
    notice: Notice


@dataclass(frozen=True)
class StopRequested:
    """A graceful stop: end the job at the next safe point (with a final checkpoint if asked)."""

    checkpoint: bool = False


@dataclass(frozen=True)
class GenerationEnded:
    outcomes: tuple[Outcome, ...]
    # it ran when its coordinator was lost, and a replacement took its workers over: their failures
    # (a store gone under their feet) are the coordinator's loss, not a bug of theirs
    coordinator_lost: bool = False


@dataclass(frozen=True)
class GenerationStepped:
    """The generation completed its first step (rank 0 reports it once per generation), heard at `at`
    (epoch seconds)."""

    number: int
    at: float = 0.0


@dataclass(frozen=True)
class FinalWeightsWritten:
    """The final weights were written (the last step's checkpoint committed): the job is over."""


@dataclass(frozen=True)
class CheckpointCommitted:
    """A checkpoint of the job was committed: a loss that memory cannot restore restores it."""


@dataclass(frozen=True)
class MemorySeen:
    """What the workers measured of memory (plan/memory.py MemoryView), as the actor put it together.
    `killed`: taught by a worker's memory kill, before its generation's end is decided (the standby
    that recovery is to take is not weighed against the dead generation)."""

    view: object
    killed: bool = False


@dataclass(frozen=True)
class Tick:
    pass


Event = Union[Start, WorkersReady, WorkerStartFailed, ReadyWorkersLost, ScaleRequested, PreemptionNotice, StopRequested,
              GenerationEnded, GenerationStepped, FinalWeightsWritten, CheckpointCommitted, MemorySeen, Tick]


@dataclass(frozen=True)
class Spawn:
    count: int


@dataclass(frozen=True)
class RequestSafePoint:
    pass


@dataclass(frozen=True)
class CheckpointNow:
    """Members told to leave cannot hand their shards to anyone before they go (no worker would stay
    above min_workers): every member saves a checkpoint at its next step, and training goes on."""


@dataclass(frozen=True)
class StartGeneration:
    plan: GenerationPlan


@dataclass(frozen=True)
class Retire:
    actor_ids: tuple[str, ...]
    lost: bool = False  # dead already: nothing is asked of them on the way out


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Stop:
    """End the job at the safe point it reached (`step` steps done), saving a checkpoint there if asked;
    `step` -1: no generation runs (starting, or waiting for workers): end it as it is."""

    step: int
    checkpoint: bool


@dataclass(frozen=True)
class Fail:
    message: str
    bad_input: bool = False  # what the spec asks cannot be had: the CLI exits 2, as for a bad spec


@dataclass(frozen=True)
class Warn:
    """Something the job does otherwise than asked, in one line (replicas dropped for memory, say)."""

    message: str
