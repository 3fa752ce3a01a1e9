"""How often a job makes replicas when `elastic.replicate_every = "auto"`: the most frequent cadence
whose copies cost at most REPLICA_BUDGET of the steps they protect. Pure: the worker measures, this
decides, and the ranks agree on the largest one proposed (worker/cadence_meter.py).

A commit moves one shard snapshot twice: off the device into host memory, then over the link to the
buddy. Both run beside the steps that follow (a side stream, a helper thread), each on its own
resource, so a cadence of `every` steps fits when the slower of the two takes at most the budget's
share of `every` steps. What memory the replicas need does not depend on the cadence (an own and a
ward copy, whatever their age): whether they fit at all is the plan's (plan/memory.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REPLICA_BUDGET = 0.05  # of the steps' time, for the copies that protect them
MOST_EVERY = 1000  # an upper bound: a replica at least every this many steps, however slow the link


@dataclass(frozen=True)
class CommitCost:
    """What one rank measured: a snapshot's bytes, the seconds to copy it off the device and to swap
    it with the buddy, and a step's time without either."""

    shard_bytes: int
    copy_s: float
    swap_s: float
    step_s: float

    def __post_init__(self) -> None:
        for name in ("copy_s", "swap_s", "step_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommitCost.{name} must be a time >= 0, got {getattr(self, name)!r}")

    @property
    def commit_s(self) -> float:
        return max(self.copy_s, self.swap_s)

    def share(self, every: int) -> float:
        """The commits' share of the steps' time at a commit every `every` steps (0 with no step measured)."""
        return self.commit_s / (every * self.step_s) if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class Cadence:
    every: int
    cost: float  # the commits' share of the steps' time at this cadence, by what was measured
    reason: str


def choose_cadence(measured: CommitCost, budget: float = REPLICA_BUDGET, most: int = MOST_EVERY) -> Cadence:
    """The smallest `every` in [1, most] with commit_s <= budget * every * step_s."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must lie in (0, 1], got {budget!r}")
    commit_s, step_s = measured.commit_s, measured.step_s
    if step_s <= 0:  # nothing to weigh the copies against (no step measured): as often as possible
        return Cadence(1, 0.0, "every step: no step time measured yet")
    every = min(most, max(1, math.ceil(commit_s / (budget * step_s) - 1e-9)))
    cost = measured.share(every)
    reason = (f"every {every} step(s): a replica of {measured.shard_bytes / 2**20:.1f} MiB takes "
              f"{measured.copy_s * 1e3:.1f} ms off the device and {measured.swap_s * 1e3:.1f} ms over the link, "
              f"{cost:.1%} of {every} step(s) of {step_s * 1e3:.1f} ms")
    if every == most and cost > budget:
        reason += f" (more than {budget:.0%}: {most} steps is the longest cadence)"
    return Cadence(every, cost, reason)


def agreed_every(largest_proposal: float) -> int:
    """The cadence every rank takes: the largest any rank proposed (one max all-reduce). The steps
    go in lockstep, so the slowest pair's copies stall every rank's step: the mean would leave
    that pair's copies over budget, and the whole job with them."""
    return max(1, math.ceil(largest_proposal - 1e-9))
