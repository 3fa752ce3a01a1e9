"""Fault drills ([[faults]]): which drills are due at a moment of a worker's generation. Pure: the
worker carries them out (and the store makes each fire once, even when a recovery repeats a step).

Moments: "handover" (inside the handover into a generation, before any shard moves), "first_step"
(before the first step of a generation, so before its layout's first commit), "step" (before
every step), "commit" (a kill or a device error at step N: inside it, once this rank has
committed step N's replicas and before the step's closing all-reduce, so that every survivor
holds step N whatever the timing; before the step, a survivor whose own copy of step N was still
arriving gave it up with the broken groups and the job went back to N - 1, seen under load;
"kill_after_save" waits there for this rank's save in flight to be written, rank 0's committed,
so that a kill right after a checkpoint has it to restore, however long a save of a real size takes),
"eval" (as the evaluation of the weights after `at_step` steps begins: the peers are then inside
it) and "final" (after the last step, before its checkpoint, the final weights, is written; or
before that checkpoint is written again, at or after `at_step`). A drill names the rank it hits in
the generation of the moment.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from elastic_zero.job.spec import FaultSpec
from elastic_zero.protocol import Source

MOMENT_OF = {"kill_in_handover": "handover", "kill_after_handover": "first_step", "kill_in_final_save": "final",
             "kill_in_eval": "eval", "kill": "commit", "kill_after_save": "commit",
             "device_error": "commit"}  # every other action: "step"


def due_drills(faults: Sequence[FaultSpec], moment: str, rank: int | None, step: int,
               plan_step: int, plan_source: str) -> Iterator[tuple[int, FaultSpec]]:
    """(index, fault) of each drill due for new rank `rank` (None: a leaver) at `moment`, at optimizer
    step `step` of a generation that started at `plan_step` from `plan_source`."""
    for i, fault in enumerate(faults):
        if MOMENT_OF.get(fault.action, "step") != moment:
            continue
        if moment in ("step", "commit", "eval"):
            due = fault.at_step == step and (fault.rank if fault.rank is not None else 0) == rank
        elif moment == "final":
            due = step >= fault.at_step and fault.rank == rank
        else:  # the first handover from at_step on, planned or an in-memory recovery
            due = plan_source in (Source.LIVE, Source.SNAPSHOT) and plan_step >= fault.at_step and fault.rank == rank
        if due:
            yield i, fault
