"""A worker's side of `elastic.replicate_every = "auto"`: what its steps and commits take in the
current generation, its proposal, and the cadence every rank agreed on (plan/cadence.py decides).

Each generation measures anew (its world size sets the shard's bytes): it commits every step until
its DECIDE_AT-th step, whose closing all-reduce carries each rank's proposal; from that step on
every rank commits every `agreed_every(sum, world)` steps. A fixed integer is taken as it is.
"""

from __future__ import annotations

import statistics

from elastic_zero.plan.cadence import Cadence, CommitCost, agreed_every, choose_cadence

DECIDE_AT = 3  # the generation's step whose all-reduce carries the proposals: two steps and a commit measured


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
        """The medians of this generation's steps and commits so far; None before a step and a commit."""
        if not self._step_s or not self._commits:
            return None
        return CommitCost(max(b for b, _, _ in self._commits), statistics.median(c for _, c, _ in self._commits),
                          statistics.median(s for _, _, s in self._commits), statistics.median(self._step_s))

    def proposal(self, steps_in_generation: int) -> float:
        """This rank's cadence for the step about to close (the count of the generation's steps done
        before it): 0 except at the deciding step of an auto cadence."""
        if not self.auto or steps_in_generation != DECIDE_AT - 1:
            return 0.0
        costs = self.measured()
        return float(choose_cadence(costs).every) if costs is not None else 1.0

    def agree(self, proposals_sum: float, world: int) -> Cadence | None:
        """Take the cadence from the step's all-reduced proposals (0: none was made at this step).
        Returns the agreed cadence when this step decided it."""
        if proposals_sum <= 0:
            return None
        self.every = agreed_every(proposals_sum, world)
        costs = self.measured()
        if costs is None:
            self.chosen = Cadence(self.every, 0.0, f"every {self.every} step(s), as the other ranks measured")
        else:
            mine = choose_cadence(costs)
            cost = costs.commit_s / (self.every * costs.step_s) if costs.step_s > 0 else 0.0
            reason = mine.reason if mine.every == self.every else \
                f"every {self.every} step(s), the ranks' mean (this rank's own: {mine.reason})"
            self.chosen = Cadence(self.every, cost, reason)
        return self.chosen

    def summary(self) -> dict:
        """The cadence in effect, for the coordinator's status and summary."""
        chosen = self.chosen
        return {"every": self.every, "auto": self.auto, "cost": round(chosen.cost, 4) if chosen else None,
                "reason": chosen.reason if chosen else None}
