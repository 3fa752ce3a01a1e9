"""The loss of a micro batch: the default next-token loss, and the contract a user's loss keeps.

`loss(model, batch)` returns the mean loss over the micro batch as a scalar tensor, or a dict with
"loss" and other scalar metrics. How much each sample counts in the global mean is the batch's
"sample_weight" (a 1-D tensor, one entry per sample; absent: 1 each): the loss of a micro batch
must be its mean weighted that way, and the step's loss is then the exact weighted mean over the
global batch whatever the world size and the micro-batch split. The default collate gives each
sample the number of its target tokens, so the default loss is the mean over every target token
of the global batch.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_KEY = "sample_weight"
IGNORE = -100  # a target that is padding: no loss term


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: a tensor, a Hugging Face ModelOutput, or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"train.loss: the default loss needs logits from the model, which returned {type(output).__name__}")
    return logits


def next_token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross entropy over the targets that are not padding, in fp32 whatever the logits' dtype.
    A micro batch of padding only gives 0 (it has no weight), not a NaN."""
    logits = logits_of(model(batch["input_ids"])).float()
    targets = batch["targets"]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)


def batch_weight(batch: dict, samples: int) -> float:
    """How much this micro batch counts in the global mean."""
    weights = batch.get(WEIGHT_KEY)
    return float(samples) if weights is None else float(weights.sum())


def batch_totals(weights: list[float], batches: list[dict], device) -> torch.Tensor:
    """This rank's part of a step's sum over ranks of the batch weights: (the weight, the micro
    batches that carry a WEIGHT_KEY, the micro batches), on `device` without a host sync (from
    pinned memory on CUDA), to be all-reduced and checked by check_batch_totals when read."""
    return _host_values_on(device, [sum(weights), sum(WEIGHT_KEY in b for b in batches), len(batches)])


def _host_values_on(device, values: list[float]) -> torch.Tensor:
    """`values` as a float64 tensor on `device`, without a host sync: torch.tensor(..., device="cuda")
    copies and then synchronizes (the host would wait for the device's queue); from pinned memory
    the copy is queued instead."""
    host = torch.tensor(values, dtype=torch.float64)
    return host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else host


def check_batch_totals(totals: list[float], step: int) -> None:
    """A ValueError naming the field if a step's all-reduced batch_totals do not add up."""
    weight, weighed, micro = totals
    if weighed not in (0.0, micro):  # counts of samples and of tokens do not add up
        raise ValueError(f"data.collate: {int(weighed)} of the step's {int(micro)} micro batches have a "
                         f"{WEIGHT_KEY!r}: give it always or never")
    if weight <= 0:
        raise ValueError(f"data: the global batch of step {step} carries no loss terms (every {WEIGHT_KEY} is 0)")


def checked(out, step: int, finite: bool = True, where: str = "train.loss",
            needs_grad: bool = True, lazy: bool = False) -> tuple[torch.Tensor, float | torch.Tensor, dict]:
    """(the loss tensor, its value, the other metrics) of what a loss function returned, the value
    and the metrics as floats (or, `lazy`, as tensors); a
    ValueError naming `where` if it is not a finite scalar (or a dict with one under "loss"), or
    (`needs_grad`: training) one that does not depend on the parameters.

    `lazy`: the value and the metrics stay tensors where they are (no read back to the host, which on
    a GPU would wait for the forward), and are not checked for being finite: the step's summary is,
    once reduced (read_step_summary)."""
    metrics: dict = {}
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"{where}: returned a dict without 'loss' (keys: {', '.join(map(str, out))})")
        for name, value in out.items():
            if name != "loss":
                metrics[str(name)] = _lazy_scalar(f"metric {name!r}", value, where) if lazy else \
                    _scalar(f"metric {name!r}", value, step, where=where)
        out = out["loss"]
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        kind = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{where}: must return a scalar tensor (or a dict with 'loss'), got {kind}")
    if needs_grad and not out.requires_grad:
        raise ValueError(f"{where}: the loss does not depend on the model's parameters (no grad_fn)")
    if lazy:
        return out.reshape(()), out.detach().reshape(()).double(), metrics
    return out.reshape(()), _scalar("the loss", out, step, finite, where), metrics


def _scalar(what: str, value, step: int, finite: bool = True, where: str = "train.loss") -> float:
    number = float(value.detach()) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise ValueError(f"{where}: {what} must be a scalar, got {type(value).__name__}")
    if finite and not math.isfinite(number):
        raise ValueError(f"{where}: {what} is {number} at step {step}")
    return float(number)


def _lazy_scalar(what: str, value, where: str):
    """A metric as a float64 0-d tensor where it is (or a float), its value not read."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).double()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: {what} must be a scalar, got {type(value).__name__}")
    return float(value)


MAX_METRICS = 16  # slots for the loss's extra metrics in the step's all-reduce, whose size every rank must share


def step_summary(asked: bool, weight: float, loss_sum: "float | torch.Tensor", metric_sums: dict, device,
                 checkpoint_asked: bool = False, where: str = "train.loss", save_busy: bool = False) -> torch.Tensor:
    """This rank's part of the one all-reduce that ends a step (a sum: a request one rank was given
    reaches them all, and the coordinator asks only one): a safe point asked for, the weight,
    the weighted loss and metrics, a check that every rank's loss returned the same metrics (a hash
    h and h * h: their sums are N * h and N * h * h only if every rank has the same h), then a
    checkpoint asked for at this step, and, last, this rank's last save still being written (then
    every rank skips a periodic save due at this step, together: a rank alone would leave its part
    waiting for rank 0's commit). The loss and the metrics may be tensors on the device (checked(lazy=True))."""
    if len(metric_sums) > MAX_METRICS:
        raise ValueError(f"{where}: returned {len(metric_sums)} metrics; at most {MAX_METRICS} are reported")
    names = sorted(metric_sums)
    h = _names_hash(names)
    values = [metric_sums[n] for n in names] + [0.0] * (MAX_METRICS - len(names))
    slots = [1.0 if asked else 0.0, weight, loss_sum, h, h * h, *values,
             1.0 if checkpoint_asked else 0.0, 1.0 if save_busy else 0.0]
    # a value still on the device (a lazy loss: checked()) is copied in there, not read back; the
    # host's values go over without blocking (a sync here made the host wait for the step's backward
    # before it could even queue the all-reduce)
    summary = _host_values_on(device, [0.0 if isinstance(v, torch.Tensor) else v for v in slots])
    for i, v in enumerate(slots):
        if isinstance(v, torch.Tensor):
            summary[i] = v
    return summary


def read_step_summary(reduced: "torch.Tensor | list", names: list[str], world: int, step: int,
                      where: str = "train.loss", finite: bool = False, finite_metrics: bool = False) -> tuple[float, dict]:
    """(the step's loss, its metrics) from the all-reduced step summary (see step_summary), a tensor
    or its values. `finite`: a loss that is not finite is a ValueError naming `where`;
    `finite_metrics`: a metric too (every rank raises it alike: the sums are the same everywhere)."""
    values = reduced.tolist() if isinstance(reduced, torch.Tensor) else list(reduced)
    h = _names_hash(names)
    if values[3] != world * h or values[4] != world * h * h:
        raise ValueError(f"{where}: the ranks returned different metrics at step {step} (this one: {names})")
    weight = values[1]
    loss, metrics = values[2] / weight, {n: values[5 + i] / weight for i, n in enumerate(names)}
    # a rank's lazy loss was not checked: the sum is not finite if one of its terms was not
    if finite and not math.isfinite(loss):
        raise ValueError(f"{where}: the loss is {loss} at step {step}")
    for name, value in metrics.items() if finite_metrics else ():
        if not math.isfinite(value):
            raise ValueError(f"{where}: metric {name!r} is {value} at step {step}")
    return loss, metrics


def _names_hash(names: list[str]) -> float:
    """A small number for a list of metric names: its square stays exact in float64 summed over ranks."""
    return float(zlib.crc32("\0".join(names).encode()) % 65521)
