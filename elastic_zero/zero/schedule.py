"""Learning-rate schedules: a multiplier of the base learning rate as a function of the step index."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    def scale(self, step: int) -> float:
        return 1.0

    def to_dict(self) -> dict:
        return {"name": "constant"}


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`.

    `step` is the index of the update about to run (0 for the first)."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < max(1, self.warmup_steps):
            raise ValueError(f"total_steps must be >= max(1, warmup_steps), got {self.total_steps}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio}")

    def scale(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_ratio
        span = max(1, self.total_steps - self.warmup_steps)
        progress = (step - self.warmup_steps) / span
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return {"name": "warmup_cosine", "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_ratio": self.min_ratio}
