"""Sharded optimizers: hyperparameters per parameter group and the update of flat shard pieces.

An optimizer here never sees a whole parameter: it updates lists of 1-D views (pieces of the
rank's shard) that share one set of hyperparameters. The arithmetic follows torch.optim's
AdamW and SGD so that one rank reproduces them.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from elastic_zero.zero.schedule import Constant, WarmupCosine


@dataclass(frozen=True)
class ParamGroup:
    """Hyperparameter overrides for the parameters whose names match `pattern` (fnmatch)."""

    pattern: str
    lr: float | None = None
    weight_decay: float | None = None


@dataclass(frozen=True)
class Hyper:
    lr: float
    weight_decay: float


def _check_groups(groups: Sequence[ParamGroup]) -> None:
    for g in groups:
        if g.lr is not None and g.lr < 0:
            raise ValueError(f"param group {g.pattern!r}: lr must be >= 0, got {g.lr}")
        if g.weight_decay is not None and g.weight_decay < 0:
            raise ValueError(f"param group {g.pattern!r}: weight_decay must be >= 0, got {g.weight_decay}")


class _Hyperparameters:
    """Per-parameter hyperparameters, shared by the optimizers below (fields lr, weight_decay,
    decay_1d, groups, schedule)."""

    def hyper_for(self, name: str, shape: tuple[int, ...]) -> Hyper:
        """No decay for 1-D parameters (biases, norms) unless decay_1d; the first matching group wins."""
        lr = self.lr
        wd = self.weight_decay if (len(shape) >= 2 or self.decay_1d) else 0.0
        for g in self.groups:
            if fnmatch.fnmatchcase(name, g.pattern):
                lr = g.lr if g.lr is not None else lr
                wd = g.weight_decay if g.weight_decay is not None else wd
                break
        return Hyper(lr=lr, weight_decay=wd)


@dataclass(frozen=True)
class AdamW(_Hyperparameters):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_1d: bool = False
    groups: tuple[ParamGroup, ...] = ()
    schedule: Constant | WarmupCosine = field(default_factory=Constant)

    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"AdamW lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"AdamW eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamW weight_decay must be >= 0, got {self.weight_decay}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "groups", tuple(self.groups))
        _check_groups(self.groups)

    def update(self, params, grads, states: Mapping[str, list], hyper: Hyper, step: int, lr_scale: float) -> None:
        """One AdamW step on matching lists of 1-D views; `step` counts from 1."""
        lr = hyper.lr * lr_scale
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        if params and params[0].is_cuda and params[0].dtype == grads[0].dtype == exp_avg[0].dtype:
            # one kernel a batch of views, where the ops below launch eight:
            fused_adamw(params, grads, exp_avg, exp_avg_sq, lr, self.betas, hyper.weight_decay, self.eps, step)
            return  # after a step's closing all-reduce the device waits for the host to queue the update
        if hyper.weight_decay:
            torch._foreach_mul_(params, 1.0 - lr * hyper.weight_decay)
        torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1.0 - beta2)
        bias1 = 1.0 - beta1**step
        bias2 = 1.0 - beta2**step
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, -lr / bias1)

    def to_dict(self) -> dict:
        return {"name": "adamw", "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "decay_1d": self.decay_1d,
                "groups": [vars(g) for g in self.groups], "schedule": self.schedule.to_dict()}


def fused_adamw(params, grads, exp_avg, exp_avg_sq, lr: float, betas: tuple[float, float], weight_decay: float,
                eps: float, step: int) -> None:
    """AdamW.update's step in torch's fused kernel (the one torch.optim.AdamW(fused=True) runs): the
    same numbers as the ops in fp32 and fp64 (the engine's masters; in bf16 the kernel computes in
    fp32 and rounds once); the step count a tensor on the views' device, filled there (made from a
    host value, it would be a copy the host waits for)."""
    count = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
    torch._fused_adamw_(params, grads, exp_avg, exp_avg_sq, [], [count] * len(params), lr=lr, beta1=betas[0],
                        beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


@dataclass(frozen=True)
class SGD(_Hyperparameters):
    """torch.optim.SGD's update; like torch it decays every parameter unless decay_1d=False."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_1d: bool = True
    groups: tuple[ParamGroup, ...] = ()
    schedule: Constant | WarmupCosine = field(default_factory=Constant)

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"SGD lr must be >= 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"SGD momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD nesterov needs momentum > 0 and dampening = 0")
        if self.weight_decay < 0:
            raise ValueError(f"SGD weight_decay must be >= 0, got {self.weight_decay}")
        object.__setattr__(self, "groups", tuple(self.groups))
        _check_groups(self.groups)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def update(self, params, grads, states: Mapping[str, list], hyper: Hyper, step: int, lr_scale: float) -> None:
        """One SGD step (torch.optim.SGD's arithmetic) on matching lists of 1-D views."""
        lr = hyper.lr * lr_scale
        d_p = grads
        if hyper.weight_decay:
            d_p = torch._foreach_add(grads, params, alpha=hyper.weight_decay)
        if self.momentum:
            buf = states["momentum"]
            if step == 1:
                torch._foreach_copy_(buf, d_p)
            else:
                torch._foreach_mul_(buf, self.momentum)
                torch._foreach_add_(buf, d_p, alpha=1.0 - self.dampening)
            if self.nesterov:
                d_p = torch._foreach_add(d_p, buf, alpha=self.momentum)
            else:
                d_p = buf
        torch._foreach_add_(params, d_p, alpha=-lr)

    def to_dict(self) -> dict:
        return {"name": "sgd", "lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "nesterov": self.nesterov, "weight_decay": self.weight_decay, "decay_1d": self.decay_1d,
                "groups": [vars(g) for g in self.groups], "schedule": self.schedule.to_dict()}
