"""A worker's side of `elastic.replicate_every = "auto"`: what its steps and commits take in the
current generation, its proposal, and the cadence every rank agreed on (plan/cadence.py decides).

Each generation measures anew (its world size sets the shard's bytes): it commits every step until
its DECIDE_AT-th step, after whose closing all-reduce every rank proposes a cadence from what it
measured and takes the largest proposed (one max all-reduce: commit/_agree_cadence). The
generation's first step is left out of the steps' time: it pays one-off costs (a recovery's or a
handover's first collectives, the allocator's growth, on a GPU its kernels' first launches), which
would make every step look slower and the replicas cheaper than they are. A fixed integer is taken
as it is.
"""

from __future__ import annotations

import statistics

from elastic_zero.plan.cadence import Cadence, CommitCost, agreed_every, choose_cadence

DECIDE_AT = 4  # the generation's step that decides: three steps done, the first of them left out


class CadenceMeter:
    def __init__(self, replicate_every: int | str) -> None:
        self.auto = replicate_every == "auto"
        self._fixed = 1 if self.auto else int(replicate_every)
        self.every = self._fixed
        self.chosen: Cadence | None = None  # this generation's agreed cadence (auto), once agreed
        self._step_s: list[float] = []
        self._commits: list[tuple[int, float, float]] = []  # (bytes, copy_s, swap_s)

    def new_generation(self) -> None:
        self.every, self.chosen = self._fixed, None
        self._step_s, self._commits = [], []

    def step_done(self, compute_s: float) -> None:
        """A step's own time: its compute and update, less any time it spent on a commit."""
        self._step_s.append(max(compute_s, 0.0))

    def commit_done(self, shard_bytes: int, copy_s: float, swap_s: float) -> None:
        self._commits.append((shard_bytes, max(copy_s, 0.0), max(swap_s, 0.0)))

    def measured(self) -> CommitCost | None:
        """The medians of this generation's steps (its first left out, while others follow) and
        commits so far; None before a step and a commit."""
        steps = self._step_s[1:] or self._step_s
        if not steps or not self._commits:
            return None
        return CommitCost(max(b for b, _, _ in self._commits), statistics.median(c for _, c, _ in self._commits),
                          statistics.median(s for _, _, s in self._commits), statistics.median(steps))

    def deciding(self, steps_in_generation: int) -> bool:
        """Whether the step just closed (the generation's `steps_in_generation`-th done before it,
        counted from 0) is the one whose ranks agree on an auto cadence."""
        return self.auto and steps_in_generation == DECIDE_AT - 1

    def proposal(self) -> float:
        """This rank's cadence from what it measured (1 with nothing measured)."""
        costs = self.measured()
        return float(choose_cadence(costs).every) if costs is not None else 1.0

    def agree(self, largest_proposal: float) -> Cadence:
        """Take the cadence the ranks agreed on: the largest proposed. Returns it, with this rank's
        measured cost at it."""
        self.every = agreed_every(largest_proposal)
        costs = self.measured()
        if costs is None:
            self.chosen = Cadence(self.every, 0.0, f"every {self.every} step(s), as the other ranks measured")
        else:
            mine = choose_cadence(costs)
            reason = mine.reason if mine.every == self.every else \
                f"every {self.every} step(s), the slowest rank's proposal (this rank's own: {mine.reason})"
            self.chosen = Cadence(self.every, costs.share(self.every), reason)
        return self.chosen

    def summary(self) -> dict:
        """The cadence in effect, for the coordinator's status and summary."""
        chosen = self.chosen
        return {"every": self.every, "auto": self.auto, "cost": round(chosen.cost, 4) if chosen else None,
                "reason": chosen.reason if chosen else None}
