"""A seeded chaos schedule: which faults hit a job, and when. Pure (a seeded generator, no clock),
so that a failing seed replays exactly.

Faults come one every 8-20 steps after the first checkpoint: SIGKILLs at a step, right after a
checkpoint step (while its background write is in flight), inside a handover and before a new
layout's first commit (each paired with the scale or preemption notice that makes the handover),
scale-ups and scale-downs, and preemption notices. A fault names a rank that exists at every world
size the job can have (min_workers or more), and a scale stays within [min_workers, max_workers].
"""

from __future__ import annotations

import random

KINDS = ("kill", "kill_after_checkpoint", "kill_in_handover", "kill_after_handover", "scale", "preempt")


def chaos_faults(seed: int, steps: int, checkpoint_every: int, min_workers: int, max_workers: int) -> list[dict]:
    """[[faults]] tables for a job of `steps` steps."""
    rng = random.Random(seed)
    faults: list[dict] = []
    step = checkpoint_every + 1
    while True:
        step += rng.randint(8, 20)
        if step >= steps - 3:
            return faults
        kind = rng.choice(KINDS)
        rank = rng.randrange(min_workers)
        if kind == "kill":
            faults.append({"at_step": step, "action": "kill", "rank": rank})
        elif kind == "kill_after_checkpoint":
            after = (step // checkpoint_every) * checkpoint_every + 1
            if after < steps and all(f["at_step"] != after for f in faults):
                faults.append({"at_step": after, "action": "kill", "rank": rank})
        elif kind in ("kill_in_handover", "kill_after_handover"):
            faults.append({"at_step": step, "action": "scale", "workers": rng.randint(min_workers, max_workers)})
            faults.append({"at_step": step, "action": kind, "rank": rank})
        elif kind == "scale":
            faults.append({"at_step": step, "action": "scale", "workers": rng.randint(min_workers, max_workers)})
        else:
            faults.append({"at_step": step, "action": "preempt", "rank": rank, "deadline_s": 30})
