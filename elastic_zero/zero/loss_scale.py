"""Dynamic loss scaling for fp16 compute: scale the loss up so small gradients survive fp16,
skip the step and back off when a gradient overflows, grow again after a run of good steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScale:
    scale: float = 2.0**16
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_scale <= 0:
            raise ValueError(f"loss scale and min_scale must be > 0, got {self.scale}, {self.min_scale}")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError("loss scale growth_factor must be > 1 and backoff_factor in (0, 1)")
        if self.growth_interval < 1:
            raise ValueError(f"loss scale growth_interval must be >= 1, got {self.growth_interval}")

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
