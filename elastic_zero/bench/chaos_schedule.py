"""A seeded chaos schedule: which faults hit a job, and when. Pure (a seeded generator, no clock),
so that a failing seed replays exactly.

Faults come one every 8-20 steps after the first checkpoint: SIGKILLs at a step, right after a
checkpoint step (while its background write is in flight), inside a handover and before a new
layout's first commit (each paired with the scale or preemption notice that makes the handover),
scale-ups and scale-downs, and preemption notices; with `--faults all`, also the coordinator's
loss, hung workers, device errors and kills in the final save (MORE_KINDS). A fault names a rank
that exists at every world size the job can have (min_workers or more), and a scale stays within
[min_workers, max_workers].
"""

from __future__ import annotations

import random

KINDS = ("kill", "kill_after_checkpoint", "kill_in_handover", "kill_after_handover", "scale", "preempt")
# what `--faults all` adds (each a [[faults]] action of its own name): the coordinator killed (its
# replacement takes the workers over), a worker hung before a step, in its data read or before a
# collective (found stuck, killed, recovered), killed once its save in flight is written, a device
# error in the step, and a kill in the final save
MORE_KINDS = ("kill_coordinator", "hang", "hang_in_data", "hang_in_collective", "kill_after_save", "device_error",
              "kill_in_final_save")


def fault_kinds(text: str) -> tuple[str, ...]:
    """`--faults`: comma-separated kinds, "all" for every one; a kind not known is one line naming it."""
    if text.strip() == "all":
        return KINDS + MORE_KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS + MORE_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--faults: {', '.join(unknown) or 'none named'}: not a fault kind of the drill "
                         f"(all, or some of {', '.join(KINDS + MORE_KINDS)})")
    return kinds


def chaos_faults(seed: int, steps: int, checkpoint_every: int, min_workers: int, max_workers: int,
                 kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """[[faults]] tables for a job of `steps` steps, of the `kinds` given (the same seed and kinds,
    the same schedule)."""
    rng = random.Random(seed)
    faults: list[dict] = []
    step = checkpoint_every + 1
    while True:
        step += rng.randint(8, 20)
        if step >= steps - 3:
            return faults
        kind = rng.choice(kinds)
        rank = rng.randrange(min_workers)
        if kind == "kill_after_checkpoint":
            after = (step // checkpoint_every) * checkpoint_every + 1
            if after < steps and all(f["at_step"] != after for f in faults):
                faults.append({"at_step": after, "action": "kill", "rank": rank})
        elif kind in ("kill_in_handover", "kill_after_handover"):
            faults.append({"at_step": step, "action": "scale", "workers": rng.randint(min_workers, max_workers)})
            faults.append({"at_step": step, "action": kind, "rank": rank})
        elif kind == "scale":
            faults.append({"at_step": step, "action": "scale", "workers": rng.randint(min_workers, max_workers)})
        elif kind == "preempt":
            faults.append({"at_step": step, "action": "preempt", "rank": rank, "deadline_s": 30})
        else:  # a kill, and every kind of MORE_KINDS: an action of the kind's name, at a rank
            faults.append({"at_step": step, "action": kind, "rank": rank})
